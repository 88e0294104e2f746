"""The engine: scheduler -> proposer -> one target forward -> sampler or verifier -> cache update."""

from __future__ import annotations

import random
import sys
from typing import Iterable, Sequence

import attrs
import torch

from specdec.backends.base import AttentionBackend
from specdec.cache.paged_cache import PagedKVCache
from specdec.engine.blocks import choose_block_size
from specdec.engine.compat import PoolSnapshot, check_engine_pools, check_target_backend, proposer_pool_uses
from specdec.engine.model_runner import Chunk, ModelRunner
from specdec.engine.scheduler import Scheduler
from specdec.engine.sequence import Sequence as EngineSequence
from specdec.models.base import CausalLM
from specdec.proposers.base import Proposal, Proposer, ProposerContext, StepFeedback
from specdec.sampling.params import SamplingParams
from specdec.sampling.sampler import Sampler, SamplingBatch
from specdec.verifiers.base import Verifier
from specdec.verifiers.greedy import GreedyVerifier
from specdec.verifiers.rejection import RejectionSampler

TARGET_POOL = "target"


@attrs.define
class EngineStats:
    """Counters since the engine was built (``num_preemptions`` is what the tests look at)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_forward_tokens: int = 0  # query tokens through the target (prefill + decode + drafts)
    num_generated_tokens: int = 0


class LLMEngine:
    """Continuous batching over a paged cache, with optional speculation, from parts passed in.

    The engine registers the target's pools (prefix ``"target"``) and the proposer's pools in
    ``cache`` (see :func:`register_pools`) and builds it; a cache that already holds them (or is
    already built) is used as it is.
    Requests are :class:`Sequence` objects made by :meth:`add_request`; :meth:`step` runs one
    forward and returns the requests that finished in it; :meth:`generate` runs a list to the end.

    - ``sampler``: draws tokens when a step has no drafts (default :class:`Sampler`).
    - ``verifier``: checks drafts; by default :class:`GreedyVerifier` for all-greedy steps and the
      lossless :class:`RejectionSampler` when any request samples (it treats greedy rows exactly
      like the greedy verifier, so per-request mixes are fine).
    - ``eos_token_ids``: stop ids for requests without ``ignore_eos``.
    - ``seed``: requests without a ``SamplingParams.seed`` get one drawn from this, at admission.

    With ``record_trace`` set, :meth:`generate` fills ``trace`` with one dict per step and request
    that had drafts: ``step`` (index within the call), ``request`` (input index),
    ``draft_token_ids``, ``num_accepted`` (the verifier's count) and ``emitted_token_ids`` (what
    was appended to the output: accepted drafts plus one token, cut after a stop token).
    """

    def __init__(
        self,
        model: CausalLM,
        cache: PagedKVCache,
        backend: AttentionBackend,
        *,
        scheduler: Scheduler | None = None,
        sampler: Sampler | None = None,
        proposer: Proposer | None = None,
        verifier: Verifier | None = None,
        block_size: int | None = None,
        max_model_len: int | None = None,
        eos_token_ids: Iterable[int] = (),
        seed: int = 0,
    ):
        self.model = model
        self.cache = cache
        self.backend = backend
        self.scheduler = scheduler or Scheduler()
        self.sampler = sampler or Sampler()
        self.proposer = proposer
        self.verifier = verifier
        self._greedy_verifier = GreedyVerifier()
        self._rejection = RejectionSampler()
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.max_model_len = int(max_model_len or _config_max_len(model))
        self.dtype = next(model.parameters()).dtype  # type: ignore[attr-defined]
        self.device = next(model.parameters()).device  # type: ignore[attr-defined]

        if not cache.is_built:
            if TARGET_POOL not in cache.pools:
                register_pools(model, cache, backend, proposer, block_size=block_size, max_model_len=self.max_model_len)
            cache.build()
        pool_names = [n for n in cache.pools if n == TARGET_POOL or n.startswith(TARGET_POOL + ".")]
        if not pool_names:
            raise ValueError(f"the cache has no {TARGET_POOL!r} pool; pass an empty, unbuilt cache")
        self.runner = ModelRunner(model, cache, backend, pool_names)
        self.pool_names = list(cache.pools)
        self.num_speculative_tokens = proposer.num_speculative_tokens if proposer is not None else 0
        self.aux_layer_ids = tuple(proposer.aux_layer_ids) if proposer is not None else ()
        self.scheduler.bind(cache, TARGET_POOL, self.num_speculative_tokens)

        self.stats = EngineStats()
        self.spec_stats = None
        if proposer is not None:
            from specdec.spec_stats import SpecStats

            self.spec_stats = SpecStats.for_k(self.num_speculative_tokens)
        self.record_trace = False
        self.trace: list[dict] = []
        self._seed_rng = random.Random(seed)
        self._next_id = 0
        self._step_index = 0

    # ----- requests -----
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, index: int = 0) -> EngineSequence:
        """Validate and queue one request; raises ``ValueError`` if it can never run."""
        seq = self.make_sequence(prompt_token_ids, params, index=index)
        self.scheduler.add(seq)
        return seq

    def make_sequence(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, index: int = 0) -> EngineSequence:
        """A validated request, not queued yet (so a batch can be checked before anything runs)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        ids = list(prompt_token_ids)
        vocab = self.model.vocab_size
        if not ids:
            raise ValueError(f"prompt {index} is empty; give at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt {index} holds token ids outside the vocabulary 0..{vocab - 1}")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens, max_model_len is {self.max_model_len}: "
                "shorten the prompt or raise max_model_len"
            )
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = EngineSequence(
            self._next_id,
            ids,
            params,
            seed=seed,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            index=index,
        )
        # A request that cannot fit even alone would wait forever: refuse it now.
        self.cache.check_fits(seq.max_kv_tokens())
        self._next_id += 1
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        use_tqdm: bool | None = False,
    ) -> list[EngineSequence]:
        """Run ``prompts`` (token ids, one ``params`` each) to completion; returns them in input order.

        All requests are validated before any runs, so a bad one fails the call without
        leaving others half done.
        """
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        seqs = [self.make_sequence(p, sp, index=i) for i, (p, sp) in enumerate(zip(prompts, params))]
        for seq in seqs:
            self.scheduler.add(seq)
        self.trace = []
        self._step_index = 0
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while self.has_unfinished():
                done = self.step()
                if bar is not None and done:
                    bar.update(len(done))
        except BaseException:
            # Interrupted (Ctrl-C) or failed: drop this call's requests so the next call starts clean.
            for seq in seqs:
                if not seq.is_finished:
                    self.scheduler.abort(seq)
                    if self.proposer is not None:
                        self.proposer.free(seq.seq_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return seqs

    # ----- one step -----
    def step(self) -> list[EngineSequence]:
        """One forward over the scheduled requests; returns those that finished."""
        batch = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        if self.proposer is not None:
            for seq in batch.preempted:
                self.proposer.free(seq.seq_id)
        seqs = batch.seqs
        if not seqs:
            return []

        drafts = self._propose(seqs, batch.max_drafts)
        cache, primary = self.cache, TARGET_POOL
        starts = [cache.num_tokens(seq.seq_id, primary) for seq in seqs]
        if drafts is None:
            token_lists = [seq.token_ids[s:] for seq, s in zip(seqs, starts)]
        else:
            token_lists = [seq.token_ids[s:] + d for seq, s, d in zip(seqs, starts, drafts.draft_token_ids)]
        output = self.runner.forward(
            [Chunk(seq.seq_id, t) for seq, t in zip(seqs, token_lists)], self.aux_layer_ids
        )
        query_lens = [len(t) for t in token_lists]

        # An all-greedy step checks drafts with the greedy verifier, which reads no sampling parameters.
        sampling = None
        if drafts is None or self.verifier is not None or not all(seq.params.greedy for seq in seqs):
            sampling = SamplingBatch.for_sequences(seqs, self.device)
        if drafts is None:
            last = torch.tensor(query_lens, device=self.device).cumsum(0) - 1
            logits = self.model.compute_logits(output.hidden_states[last])
            emitted = [[t] for t in self.sampler.sample(logits, sampling).tolist()]
            num_drafts = num_accepted = None
        else:
            num_drafts = [len(d) for d in drafts.draft_token_ids]
            num_accepted, emitted = self._verify(output, query_lens, num_drafts, drafts, sampling)

        return self._finish_step(seqs, starts, query_lens, emitted, drafts, num_drafts, num_accepted, output)

    def _propose(self, seqs: list[EngineSequence], max_drafts: list[int]) -> Proposal | None:
        if self.proposer is None or not any(max_drafts):
            return None
        proposal = self.proposer.propose(seqs, max_drafts)
        ids = proposal.draft_token_ids
        if len(ids) != len(seqs) or any(len(d) > m for d, m in zip(ids, max_drafts)):
            raise RuntimeError(
                f"proposer {type(self.proposer).__name__} returned drafts that break max_drafts={max_drafts}: "
                f"{[len(d) for d in ids]}"
            )
        if not any(ids):
            return None
        return proposal

    def _verify(self, output, query_lens, num_drafts, drafts: Proposal, sampling: SamplingBatch | None):
        k = self.num_speculative_tokens
        # The last (num_drafts + 1) rows of each request's chunk are its verify rows.
        rows, end = [], 0
        for q, n in zip(query_lens, num_drafts):
            end += q
            rows.extend(range(end - n - 1, end))
        logits = self.model.compute_logits(output.hidden_states[torch.tensor(rows, device=self.device)])
        padded = torch.tensor([d + [-1] * (k - len(d)) for d in drafts.draft_token_ids], device=self.device)
        verifier = self.verifier
        if verifier is None:
            verifier = self._greedy_verifier if sampling is None else self._rejection
        result = verifier.verify(
            logits, padded, torch.tensor(num_drafts, device=self.device), drafts.draft_probs, sampling
        )
        return result.num_accepted.tolist(), result.emitted()

    def _finish_step(self, seqs, starts, query_lens, emitted, drafts, num_drafts, num_accepted, output):
        finished = []
        generated = 0
        cache, scheduler = self.cache, self.scheduler
        for i, seq in enumerate(seqs):
            before = seq.num_tokens
            generated += seq.append(emitted[i])
            if self.record_trace and num_drafts is not None and num_drafts[i]:
                self.trace.append(
                    {
                        "step": self._step_index,
                        "request": seq.index,
                        "draft_token_ids": list(drafts.draft_token_ids[i]),
                        "num_accepted": num_accepted[i],
                        "emitted_token_ids": seq.token_ids[before:],
                    }
                )
            if seq.is_finished:
                finished.append(seq)
                continue
            if self.proposer is not None:
                # Rejected drafts (and the drafter's tokens past them) leave every pool.
                keep = seq.num_tokens - 1
                for name in self.pool_names:
                    if cache.num_tokens(seq.seq_id, name) > keep:
                        cache.truncate(seq.seq_id, keep, [name])
        if self.proposer is not None:
            row_starts = [0]
            for q in query_lens[:-1]:
                row_starts.append(row_starts[-1] + q)
            zeros = [0] * len(seqs)
            self.proposer.on_step(
                StepFeedback(
                    seqs=seqs,
                    row_starts=row_starts,
                    query_lens=query_lens,
                    start_positions=starts,
                    num_drafts=num_drafts or zeros,
                    num_accepted=num_accepted or zeros,
                    target_output=output,
                )
            )
            if num_drafts is not None:
                self.spec_stats.observe(num_drafts, num_accepted)
        for seq in finished:
            scheduler.finish(seq)
            if self.proposer is not None:
                self.proposer.free(seq.seq_id)
        self.stats.num_steps += 1
        self.stats.num_forward_tokens += sum(query_lens)
        self.stats.num_generated_tokens += generated
        self._step_index += 1
        return finished


def register_pools(
    model: CausalLM,
    cache: PagedKVCache,
    backend: AttentionBackend,
    proposer: Proposer | None,
    *,
    block_size: int | None = None,
    max_model_len: int | None = None,
) -> list[str]:
    """Register the target's pools (prefix ``"target"``) and let the proposer register its own.

    Split from building so that a caller can size the budget from the registered pools first
    (``LLM`` does, for its default ``kv_cache_memory``). Then checks that every backend can run every
    pool it uses (:func:`specdec.engine.compat.check_engine_pools`; an impossible combination of page
    sizes raises :class:`~specdec.engine.compat.PageSizeError`). Returns the target's pool names.
    """
    check_target_backend(model, backend)
    dtype = next(model.parameters()).dtype  # type: ignore[attr-defined]
    size = choose_block_size(model, backend, block_size, dtype)
    pools = [cache.register(p) for p in model.kv_pools(TARGET_POOL, size, dtype)]
    draft_uses = []
    if proposer is not None:
        before = PoolSnapshot.of(cache)
        proposer.setup(
            ProposerContext(
                target=model,
                target_pools=pools,
                cache=cache,
                backend=backend,
                dtype=dtype,
                device=next(model.parameters()).device,  # type: ignore[attr-defined]
                max_model_len=int(max_model_len or _config_max_len(model)),
            )
        )
        draft_uses = proposer_pool_uses(cache, before, pools, proposer, backend)
    # Before any memory is allocated: one backend that cannot run a pool it uses fails here, in one line.
    check_engine_pools(pools, backend, draft_uses, required_block_size=getattr(model, "required_block_size", None))
    return [p.name for p in pools]


def _config_max_len(model: CausalLM) -> int:
    value = getattr(model.hf_config, "max_position_embeddings", None)
    if not value:
        raise ValueError("the model config has no max_position_embeddings; pass max_model_len")
    return int(value)
