"""The draft-model proposer: an independent small causal LM drafts k tokens autoregressively."""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

from specdec.backends import get_backend
from specdec.models.loader import apply_kv_scales, load_model
from specdec.proposers.base import ModelProposer, Proposal, ProposerContext, ProposerPools
from specdec.proposers.chain import draft_chain
from specdec.runtime.block_size import choose_block_size
from specdec.runtime.model_runner import Chunk, ModelRunner
from specdec.sampling.processing import target_probs
from specdec.sampling.random import STREAM_DRAFT, categorical
from specdec.sampling.sampler import SamplingBatch

DRAFT_POOL = "draft"


class DraftModelProposer(ModelProposer):
    """Drafts with any supported architecture sharing the target's vocabulary.

    Keys: :class:`~specdec.proposers.options.ModelOptions` (``model``, ``attention_backend``,
    ``block_size``, ``draft_sample_method``, ``quantization``). The draft keeps its own KV pool(s) (prefix ``"draft"``,
    page size ``block_size`` or what its backend prefers) in the shared cache. Each step it first catches up on the tokens it has not
    seen (the whole prompt for a new or preempted request; the accepted tokens and the emitted one
    otherwise), then runs one decode per further draft. Greedy requests draft the argmax (q is
    one-hot, ``draft_probs`` None when the whole step is greedy), and so does every request with
    ``draft_sample_method="greedy"``; with ``"probabilistic"`` sampling requests draw each draft from
    q = ``target_probs`` of the draft's logits with the request's own parameters, seeded by (request
    seed, position, ``STREAM_DRAFT``), and report q for the verifier.

    Rollback is the engine's: after verification it truncates the draft's pools (declared ``own``)
    to the request's verified length, which for the draft is exactly the KV it can keep.
    """

    model = None
    runner: ModelRunner | None = None

    def setup(self, context: ProposerContext) -> ProposerPools:
        model = self.quantized(load_model(self.model_path, dtype=context.dtype, device=context.device))
        if model.vocab_size != context.target.vocab_size:
            raise ValueError(
                f"draft model {self.model_path!r} has a vocabulary of {model.vocab_size} tokens, the target "
                f"{context.target.vocab_size}; a draft_model must share the target's vocabulary"
            )
        backend = get_backend(self.attention_backend) if self.attention_backend else context.backend
        size = choose_block_size(model, backend, self.block_size, context.kv_dtype, what="speculative config block_size")
        registered = [context.cache.register(p) for p in model.kv_pools(DRAFT_POOL, size, context.kv_dtype)]
        apply_kv_scales(model, registered)
        pools = tuple(p.name for p in registered)
        self.model = model
        self.runner = ModelRunner(model, context.cache, backend, pools)
        self._target_pool = context.target_pools[0].name
        return ProposerPools(backend=backend, own=pools)

    def propose(self, seqs: Sequence, max_drafts: Sequence[int]) -> Proposal:
        runner = self.runner
        if runner is None:
            raise RuntimeError("DraftModelProposer.setup() must run before propose(); the engine calls it")
        cache, primary = runner.cache, runner.pool_names[0]
        # Catch up on every unseen token: a drafting request up to its last token, any other one (a
        # prompt being prefilled in chunks) as far as the target has computed, chunk by chunk.
        chunks, active, last_rows, rows = [], [], [], 0
        for i, seq in enumerate(seqs):
            have = cache.num_tokens(seq.seq_id, primary)
            end = seq.num_tokens if max_drafts[i] > 0 else cache.num_tokens(seq.seq_id, self._target_pool)
            if end <= have:
                continue
            chunks.append(Chunk(seq.seq_id, seq.token_ids[have:end]))
            rows += end - have
            if max_drafts[i] > 0:
                active.append(i)
                last_rows.append(rows - 1)
        if not active:
            if chunks:
                runner.forward(chunks)
            return Proposal([[] for _ in seqs])
        drafting = [seqs[i] for i in active]
        out = runner.forward(chunks)
        index = torch.tensor(last_rows, dtype=torch.long, device=runner.device)

        def advance(_step: int, _kept: list[int], rows: list[int], tokens: list[int]) -> torch.Tensor:
            return runner.forward([Chunk(drafting[r].seq_id, [t]) for r, t in zip(rows, tokens)]).hidden_states

        return draft_chain(
            drafting, active, [max_drafts[i] for i in active], out.hidden_states[index], self._draw, advance,
            batch_size=len(seqs), num_speculative_tokens=self.num_speculative_tokens,
            vocab_size=self.model.vocab_size, device=runner.device, sample=self.samples_drafts,
        )

    def calibration_step(self, requests: Sequence[Hashable]) -> bool:
        """A chain step's forward and greedy draw (:class:`~specdec.proposers.base.ProposerBase`)."""
        self._draw(self.runner.forward([Chunk(request, [0]) for request in requests]).hidden_states, None, 0)
        return True

    def _draw(self, hidden: torch.Tensor, batch: SamplingBatch | None, step: int):
        """Draft tokens for one position (from the draft's final hidden states) and, when any row
        samples, their distributions q."""
        if batch is None:
            return self.model.greedy_ids(hidden), None
        return _sample(self.model.compute_logits(hidden), batch, step)


def _sample(logits: torch.Tensor, batch: SamplingBatch, step: int):
    """Draw from q = the request's processed distribution of ``logits``; return the tokens and q."""
    q = target_probs(logits, batch.temperature, batch.top_k, batch.top_p)
    tokens = categorical(q, batch.seeds, batch.counters + step, STREAM_DRAFT)
    # Greedy rows' q is the one-hot of the argmax, so the draw above already picks it.
    return tokens, q
