"""The draft-model proposer: an independent small causal LM drafts k tokens autoregressively."""

from __future__ import annotations

from typing import Sequence

import torch

from specdec.backends import get_backend
from specdec.engine.blocks import choose_block_size
from specdec.engine.model_runner import Chunk, ModelRunner
from specdec.models.loader import load_model
from specdec.proposers.base import Proposal, ProposerBase, ProposerContext
from specdec.sampling.processing import greedy_ids, target_probs
from specdec.sampling.random import STREAM_DRAFT, categorical
from specdec.sampling.sampler import SamplingBatch

DRAFT_POOL = "draft"


class DraftModelProposer(ProposerBase):
    """Drafts with any supported architecture sharing the target's vocabulary.

    The draft keeps its own KV pool(s) (prefix ``"draft"``, page size ``block_size`` or what its
    backend prefers) in the shared cache. Each step it first catches up on the tokens it has not
    seen (the whole prompt for a new or preempted request; the accepted tokens and the emitted one
    otherwise), then runs one decode per further draft. Greedy requests draft the argmax (q is
    one-hot, ``draft_probs`` None when the whole step is greedy); sampling requests draw each
    draft from q = ``target_probs`` of the draft's logits with the request's own parameters,
    seeded by (request seed, position, ``STREAM_DRAFT``), and report q for the verifier.

    Rollback is the engine's generic truncation: after verification every pool is cut to the
    request's verified length, which for the draft is exactly the KV it can keep.
    """

    def __init__(
        self,
        model: str,
        num_speculative_tokens: int,
        *,
        attention_backend: str | None = None,
        block_size: int | None = None,
    ):
        if not (isinstance(num_speculative_tokens, int) and num_speculative_tokens >= 1):
            raise ValueError(f"num_speculative_tokens must be an int >= 1, got {num_speculative_tokens!r}")
        self.model_path = model
        self.num_speculative_tokens = num_speculative_tokens
        self.attention_backend = attention_backend
        self.block_size = block_size
        self.model = None
        self.runner: ModelRunner | None = None

    @classmethod
    def from_config(cls, config) -> "DraftModelProposer":
        return cls(
            config.model,
            config.num_speculative_tokens,
            attention_backend=config.attention_backend,
            block_size=config.block_size,
        )

    def setup(self, context: ProposerContext) -> None:
        model = load_model(self.model_path, dtype=context.dtype, device=context.device)
        if model.vocab_size != context.target.vocab_size:
            raise ValueError(
                f"draft model {self.model_path!r} has a vocabulary of {model.vocab_size} tokens, the target "
                f"{context.target.vocab_size}; a draft_model must share the target's vocabulary"
            )
        backend = get_backend(self.attention_backend) if self.attention_backend else context.backend
        size = choose_block_size(model, backend, self.block_size, context.dtype, what="speculative config block_size")
        pools = [context.cache.register(p) for p in model.kv_pools(DRAFT_POOL, size, context.dtype)]
        self.pool_names = tuple(p.name for p in pools)
        self.model = model
        self.runner = ModelRunner(model, context.cache, backend, self.pool_names)

    def propose(self, seqs: Sequence, max_drafts: Sequence[int]) -> Proposal:
        runner = self.runner
        if runner is None:
            raise RuntimeError("DraftModelProposer.setup() must run before propose(); the engine calls it")
        active = [i for i, m in enumerate(max_drafts) if m > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        if not active:
            return Proposal(drafts)
        cache, primary = runner.cache, self.pool_names[0]
        sampled = not all(seqs[i].params.greedy for i in active)
        batch, probs = None, None  # all-greedy steps draft the argmax and need neither
        if sampled:
            batch = SamplingBatch.for_sequences([seqs[i] for i in active], runner.device)
            vocab = self.model.vocab_size
            probs = torch.zeros(len(seqs), self.num_speculative_tokens, vocab, dtype=torch.float64, device=runner.device)

        # Catch up on every unseen token, then one decode per further draft.
        chunks = [Chunk(seqs[i].seq_id, seqs[i].token_ids[cache.num_tokens(seqs[i].seq_id, primary) :]) for i in active]
        out = runner.forward(chunks)
        ends = torch.tensor([len(c.token_ids) for c in chunks]).cumsum(0) - 1
        logits = self.model.compute_logits(out.hidden_states[ends.to(runner.device)])
        rows = list(range(len(active)))  # rows of ``batch`` still drafting
        step = 0
        while True:
            tokens, q = _draw(logits, batch, step, sampled)
            token_list = tokens.tolist()
            for r, token in zip(rows, token_list):
                drafts[active[r]].append(token)
            if q is not None:
                probs[torch.tensor([active[r] for r in rows]), step] = q
            step += 1
            keep = [n for n, r in enumerate(rows) if max_drafts[active[r]] > step]
            if not keep:
                break
            rows = [rows[n] for n in keep]
            if sampled and len(keep) < len(token_list):
                batch = batch.select(torch.tensor(keep))
            out = runner.forward([Chunk(seqs[active[r]].seq_id, [drafts[active[r]][-1]]) for r in rows])
            logits = self.model.compute_logits(out.hidden_states)
        return Proposal(drafts, probs)


def _draw(logits: torch.Tensor, batch: SamplingBatch | None, step: int, sampled: bool):
    """Draft tokens for one position and, when any row samples, their distributions q."""
    if not sampled:
        return greedy_ids(logits), None
    q = target_probs(logits, batch.temperature, batch.top_k, batch.top_p)
    tokens = categorical(q, batch.seeds, batch.counters + step, STREAM_DRAFT)
    # Greedy rows' q is the one-hot of the argmax, so the draw above already picks it.
    return tokens, q
