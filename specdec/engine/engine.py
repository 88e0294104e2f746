"""The engine: scheduler -> proposer -> one target forward -> sampler or verifier -> commit.

Who writes the paged cache, by phase of a step (nobody else does):

1. *schedule*: nobody. The scheduler reads free pages and decides who runs (reserving pages for each
   request's tokens plus k drafts in every pool, by counting), who is admitted, who is preempted.
2. *release and admit*: the engine frees the pages of the requests it preempted, starts the sequences
   of newly admitted requests in the proposer's prompt-free pools at their prompt length, and in every
   other pool from the cached pages the scheduler found (prefix caching).
3. *propose*: the proposer appends the rows it keeps to its own pools; rows it needs only for the
   proposal (the draft chain, rows ahead of the target in a target pool it joined) go in a cache
   scratch scope, which restores every length on exit.
4. *target forward*: the model runner appends the step's tokens and drafts to the target's pools.
5. *verify or sample*: nobody.
6. *commit*: the engine truncates the target's and the proposer's own pools to each request's verified
   length, tells the proposer (:class:`StepFeedback`; it may complete a finished request's rows),
   publishes the pages that became full and final to the prefix cache and frees finished requests'
   pages.
"""

from __future__ import annotations

import itertools
import random
import sys
from typing import Callable, Iterable, Sequence

import attrs

from specdec.backends import invariance
from specdec.backends.base import AttentionBackend
from specdec.cache.paged_cache import PagedKVCache
from specdec.distributed import parallel_state as ps
from specdec.distributed.step_sync import StepSync
from specdec.engine.acceptance_alarm import AcceptanceAlarm
from specdec.engine.compat import check_batch_invariant
from specdec.engine.calibration import calibrate
from specdec.engine.draft_counts import FixedDrafts
from specdec.engine.goodput import GoodputController
from specdec.engine.pools import TARGET_POOL, EnginePools, register_pools
from specdec.engine.prefix_caching import PrefixCacheStats, PrefixCaching
from specdec.engine.scheduler import Scheduler
from specdec.models.base import CausalLM, config_max_len
from specdec.outputs import RequestStep, StepOutput
from specdec.proposers.base import Proposal, Proposer, StepFeedback
from specdec.runtime.layout import StepLayout
from specdec.runtime.model_runner import ModelRunner
from specdec.runtime.sequence import Sequence as EngineSequence, checked_prompt
from specdec.sampling.logprobs import new_token_logprobs, prompt_logprobs
from specdec.sampling.params import SamplingParams
from specdec.sampling.sampler import Sampler, SamplingBatch
from specdec.spec_stats import SpecStats
from specdec.verifiers.base import Verifier
from specdec.verifiers.select import VerifierChoice


@attrs.define
class EngineStats:
    """Counters since the engine was built (``num_preemptions`` is what the tests look at)."""

    num_steps: int = 0
    num_preemptions: int = 0
    num_forward_tokens: int = 0  # query tokens through the target (prefill + decode + drafts)
    num_generated_tokens: int = 0


class LLMEngine:
    """Continuous batching over a paged cache, with optional speculation, from parts passed in.

    An unbuilt ``cache`` gets the target's pools (prefix ``"target"``) and the proposer's
    (:func:`register_pools`) and is built here; a caller that registered them itself passes the
    :class:`EnginePools` that ``register_pools`` returned. Requests are :class:`Sequence` objects made by
    :meth:`add_request`; :meth:`step` runs one step and returns a :class:`StepOutput` (what each
    request emitted, its drafts, which finished); :meth:`generate` runs a list to the end.

    - ``sampler``: draws tokens when a step has no drafts (default :class:`Sampler`).
    - ``verifier``: checks every step's drafts; by default the one
      :class:`~specdec.verifiers.select.VerifierChoice` picks for the step (greedy, coupled or rejection
      sampling). ``spec_stats.num_drafts_by_verifier`` counts which verified what.
    - ``eos_token_ids``: stop ids for requests without ``ignore_eos``.
    - ``seed``: requests without a ``SamplingParams.seed`` get one drawn from this, at admission.
    - ``enable_prefix_caching``: reuse cached pages of identical prefixes (:mod:`specdec.engine.prefix_caching`).
    - ``sync``: under tensor parallelism, this rank's :class:`~specdec.distributed.step_sync.StepSync`
      (the driver broadcasts added and aborted requests before every step; every rank then steps).
    - ``adaptive``: choose each request's drafts per step, up to k, for the most tokens per second
      (:mod:`specdec.engine.goodput`; ``recorded_acceptance``, the draft checkpoint's per position, is
      its prior); otherwise every request that may draft gets k.
    - ``batch_invariant``: every step runs in :func:`specdec.backends.invariance.batch_invariant`, so each
      row's result is independent of the batch (greedy speculative output equals plain output bit for
      bit in any dtype); backends without the mode are refused here.
    - ``acceptance_alarm``: warns when acceptance collapses, for the draft or one request
      (:mod:`specdec.engine.acceptance_alarm`); its warnings, and the draft's at load, go to
      ``spec_stats.warnings``.
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
        pools: EnginePools | None = None,
        enable_prefix_caching: bool = True,
        sync: StepSync | None = None,
        adaptive: bool = False,
        recorded_acceptance: Sequence[float] | None = None,
        batch_invariant: bool = False,
        acceptance_alarm: AcceptanceAlarm | None = None,
    ):
        self.model = model
        self.cache = cache
        self.scheduler = scheduler or Scheduler()
        self.sampler = sampler or Sampler()
        self.proposer = proposer
        self.verifiers = VerifierChoice(self.sampler, verifier)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.max_model_len = int(max_model_len or config_max_len(model))
        self.device = next(model.parameters()).device

        if pools is None:
            if cache.is_built or cache.pools:
                raise ValueError("pass an empty, unbuilt cache, or the EnginePools register_pools returned for it")
            pools = register_pools(model, cache, backend, proposer, block_size=block_size,
                                   max_model_len=self.max_model_len)
        self.batch_invariant = bool(batch_invariant)
        if self.batch_invariant:
            check_batch_invariant(backend, pools.draft.backend)
        if not cache.is_built:
            cache.build()
        self.pools = pools
        self.runner = ModelRunner(model, cache, backend, pools.target)
        self.num_speculative_tokens = proposer.num_speculative_tokens if proposer is not None else 0
        self.aux_layer_ids = tuple(proposer.aux_layer_ids) if proposer is not None else ()
        self.prefix = PrefixCaching(cache, pools, proposer, enabled=enable_prefix_caching)
        self.scheduler.bind(cache, TARGET_POOL, self.num_speculative_tokens, self.prefix,
                            dormant=lambda requests: self.draft_counts.admit(requests))

        self.sync = sync
        self.stats = EngineStats()
        self.spec_stats = SpecStats.for_k(self.num_speculative_tokens) if proposer is not None else None
        self.alarm = acceptance_alarm if proposer is not None else None
        if self.alarm is not None:
            self.spec_stats.warnings.extend(self.alarm.expectation.load_warnings)
        self.draft_counts = FixedDrafts()  # how many drafts each request gets per step
        if adaptive and proposer is not None:
            self.draft_counts = GoodputController(self.num_speculative_tokens, recorded=recorded_acceptance,
                                                  device=self.device)
            config = self.scheduler.config
            calibrate(self.draft_counts, self._forward, cache.free, max_requests=config.max_num_seqs,
                      max_rows=min(config.max_num_seqs * (self.num_speculative_tokens + 1),
                                   config.max_num_batched_tokens or self.max_model_len),
                      vocab_size=self.model.vocab_size, draft_step=getattr(proposer, "calibration_step", None))
        self._seed_rng = random.Random(seed)
        self._next_id = 0

    # ----- requests -----
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, index: int = 0) -> EngineSequence:
        """Validate and queue one request; raises ``ValueError`` if it can never run."""
        seq = self.make_sequence(prompt_token_ids, params, index=index)
        self.add_sequence(seq)
        return seq

    def add_sequence(self, seq: EngineSequence) -> None:
        """Queue a request made by :meth:`make_sequence`."""
        self.scheduler.add(seq)
        if self.sync is not None:
            self.sync.added(seq)

    def make_sequence(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, index: int = 0) -> EngineSequence:
        """A validated request, not queued yet (so a batch can be checked before anything runs)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        ids = checked_prompt(prompt_token_ids, self.model.vocab_size, self.max_model_len, index)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = EngineSequence(self._next_id, ids, params, seed=seed, eos_token_ids=self.eos_token_ids,
                             max_model_len=self.max_model_len, index=index)
        # A request that cannot fit even alone would wait forever: refuse it now.
        self.cache.check_fits(seq.max_kv_tokens())
        self._next_id += 1
        return seq

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prompt tokens looked up in the prefix cache and found there, since the engine was built."""
        return self.prefix.stats

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def running_ids(self) -> list[int]:
        """The requests holding KV now (the ones a step runs)."""
        return [seq.seq_id for seq in self.scheduler.running]

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def abort(self, request_id: int, reason: str = "abort") -> None:
        """Finish request ``request_id`` now if it is unfinished, wherever it is, with ``finish_reason``
        ``reason`` (a front end ends one with ``"stop"`` at a stop string): its pages and the proposer's
        state go at once."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return
        if self.sync is not None:
            self.sync.aborted(request_id, reason)
        self.scheduler.abort(seq, reason)
        self.cache.free(seq.seq_id)
        self.prefix.release(seq.seq_id)
        self.draft_counts.forget(seq.seq_id)
        if self.alarm is not None:
            self.alarm.forget(seq.seq_id)
        if self.proposer is not None:
            self.proposer.on_step(StepFeedback(finished=(seq.seq_id,)))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: Sequence[SamplingParams],
        *,
        use_tqdm: bool | None = False,
        on_step: Callable[[StepOutput], None] | None = None,
    ) -> list[EngineSequence]:
        """Run ``prompts`` (token ids, one ``params`` each) to completion; returns them in input order.

        All requests are validated before any runs, so a bad one fails the call without leaving
        others half done. ``on_step`` is called with every step's :class:`StepOutput`.
        """
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt")
        seqs = [self.make_sequence(p, sp, index=i) for i, (p, sp) in enumerate(zip(prompts, params))]
        self.run(seqs, use_tqdm=use_tqdm, on_step=on_step)
        return seqs

    def run(
        self,
        seqs: Sequence[EngineSequence],
        *,
        use_tqdm: bool | None = False,
        on_step: Callable[[StepOutput], None] | None = None,
    ) -> None:
        """Queue ``seqs`` (made by :meth:`make_sequence`) and step until nothing is left unfinished.

        Interrupted (Ctrl-C) or failed, it drops these requests, so the next call starts clean.
        """
        for seq in seqs:
            self.add_sequence(seq)
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        bar = None
        if show:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="generate", unit="req", dynamic_ncols=True)
        try:
            while self.has_unfinished():
                out = self.step()
                if on_step is not None:
                    on_step(out)
                if bar is not None and out.finished:
                    bar.update(len(out.finished))
        except BaseException:
            for seq in seqs:
                self.abort(seq.seq_id)
            raise
        finally:
            if bar is not None:
                bar.close()

    # ----- lockstep under tensor parallelism -----
    def lockstep_state(self):
        """What this rank decides from that is its own (the adaptive controller's timings): the driver
        sends its own with each step, and every rank adopts it (:meth:`load_lockstep_state`)."""
        return self.draft_counts.cost_state()

    def load_lockstep_state(self, state) -> None:
        self.draft_counts.load_cost_state(state)

    # ----- one step -----
    def step(self) -> StepOutput:
        """One step over the scheduled requests (phases in the module docstring)."""
        if self.sync is None:
            return self._step()
        return self.sync.step(self, self._step)  # every rank takes the same step on the same requests

    def _step(self) -> StepOutput:
        with invariance.batch_invariant(self.batch_invariant):  # the proposer's forwards and the target's
            return self._run_step()

    def _run_step(self) -> StepOutput:
        self.draft_counts.step_began()
        batch = self.scheduler.schedule()
        self.stats.num_preemptions = self.scheduler.num_preemptions
        preempted = tuple(seq.seq_id for seq in batch.preempted)
        for request in preempted:
            self.cache.free(request)
        seqs = batch.seqs
        if not seqs:
            if preempted and self.proposer is not None:
                self.proposer.on_step(StepFeedback(preempted=preempted))
            return StepOutput(self.stats.num_steps)
        self._admit(seqs, batch.reuse)

        # An admitted request may recompute the last reused positions (for the proposer's hidden states).
        recomputed = {r: m.num_recomputed for r, m in batch.reuse.items()}
        starts = [self.cache.num_tokens(seq.seq_id, TARGET_POOL) - recomputed.get(seq.seq_id, 0)
                  for seq in seqs]
        ends = [s + n for s, n in zip(starts, batch.num_new_tokens)]
        samples = [end == seq.num_tokens for seq, end in zip(seqs, ends)]
        max_drafts = self._choose_drafts(seqs, batch.max_drafts, batch.num_new_tokens.count(1))
        self.draft_counts.lap("other")
        drafts = self._propose(seqs, max_drafts)
        self.draft_counts.lap("draft")
        draft_ids = drafts.draft_token_ids if drafts is not None else [[] for _ in seqs]
        tokens = [seq.token_ids[s:e] + d for seq, s, e, d in zip(seqs, starts, ends, draft_ids)]
        layout = StepLayout.build(
            [seq.seq_id for seq in seqs], starts, [len(t) for t in tokens], [len(d) for d in draft_ids], self.device,
            samples,
        )
        output, logits = self._forward(layout, tokens)
        self.draft_counts.lap("target")

        # Only requests whose rows reach their last token sample; a prompt chunk ending earlier emits nothing.
        sampling_seqs = [seqs[i] for i in layout.sampling]
        greedy = all(s.params.greedy for s in sampling_seqs)  # argmax decides: no parameters to build
        sampling = None
        if sampling_seqs and (not greedy or (drafts is not None and self.verifiers.needs_sampling_batch())):
            sampling = SamplingBatch.for_sequences(sampling_seqs, self.device)
        emitted, num_accepted = [[] for _ in seqs], [0] * len(seqs)
        if drafts is None and sampling_seqs:
            for i, token in zip(layout.sampling, self.sampler.sample(logits, sampling).tolist()):
                emitted[i] = [token]
        elif drafts is not None:  # a request with drafts always samples
            verdict = self.verifiers.verify(logits, layout, drafts.draft_token_ids, drafts.draft_probs, sampling,
                                            self.num_speculative_tokens)
            self.spec_stats.count_verified(verdict.verifier, sum(layout.num_drafts[i] > 0 for i in layout.sampling))
            for j, i in enumerate(layout.sampling):
                num_accepted[i], emitted[i] = verdict.num_accepted[j], verdict.emitted[j]
        out = self._commit(seqs, layout, max_drafts, draft_ids, emitted, num_accepted, output, logits, preempted)
        self.draft_counts.step_ended(layout)
        return out

    def _admit(self, seqs: list[EngineSequence], reuse) -> None:
        """Start the pools of requests admitted this step: prompt-free pools at the prompt length, and
        every other pool from the cached pages the scheduler found for it."""
        prompt_free = self.pools.draft.prompt_free
        for seq in seqs:
            if self.cache.num_tokens(seq.seq_id, TARGET_POOL):
                continue  # running already
            if prompt_free:
                self.cache.set_start(seq.seq_id, seq.num_prompt_tokens, prompt_free)
            self.prefix.admit(seq, reuse.get(seq.seq_id))

    def _forward(self, layout: StepLayout, tokens: list[list[int]]):
        """The target's forward over the step's rows, and the logits of its verify rows."""
        # Aux layers only feed proposers keeping draft state: none is kept for dormant requests.
        keeping = not all(map(self.draft_counts.is_dormant, layout.requests))
        output = self.runner.run(layout, tokens, self.aux_layer_ids if keeping else ())
        return output, self.model.compute_logits(output.hidden_states[layout.verify_rows])

    def _choose_drafts(self, seqs: list[EngineSequence], caps: list[int], base_rows: int) -> list[int]:
        """Each request's drafts this step: the scheduler's cap, or what the adaptive controller chooses
        under it (``base_rows``: the decoding requests' rows, one each)."""
        chosen = caps
        if any(caps):
            chosen = self.draft_counts.choose([seq.seq_id for seq in seqs], caps, base_rows)
        if self.spec_stats is not None:
            self.spec_stats.count_chosen(chosen, caps)
        return chosen

    def _propose(self, seqs: list[EngineSequence], max_drafts: list[int]) -> Proposal | None:
        if self.proposer is None or not any(max_drafts):
            return None
        with ps.phase("draft"):  # counts the draft's collectives apart from the target's
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

    def _commit(self, seqs, layout, chosen, draft_ids, emitted, num_accepted, output, logits, preempted) -> StepOutput:
        """Append what each request emitted, cut every pool back to the verified length, release the
        finished, tell the proposer; the step's :class:`StepOutput` (``chosen``: each request's drafts
        allowed; ``logits``: the verify rows', for the logprobs a request asks for)."""
        cache, truncated = self.cache, self.pools.per_request
        results, finished = [], []
        generated = 0
        first_rows = dict(zip(layout.sampling, itertools.accumulate(
            (layout.num_drafts[i] + 1 for i in layout.sampling), initial=0)))
        for i, seq in enumerate(seqs):
            if not layout.samples[i]:
                continue  # a prompt chunk: nothing emitted, nothing to roll back
            before = seq.num_tokens
            generated += seq.append(emitted[i])
            new = tuple(seq.token_ids[before:])
            results.append(RequestStep(
                seq.seq_id, seq.index, new, tuple(draft_ids[i]), num_accepted[i] if draft_ids[i] else 0,
                seq.finish_reason, num_drafts_chosen=chosen[i],
                logprobs=new_token_logprobs(seq, new, logits[first_rows[i] :]),
                prompt_logprobs=prompt_logprobs(self.model, seq, layout, i, output),
            ))
            if seq.is_finished:
                finished.append(seq)
            elif self.proposer is not None:
                # Rejected drafts (and the drafter's tokens past them) leave every pool.
                keep = seq.num_tokens - 1
                for name in truncated:
                    if cache.num_tokens(seq.seq_id, name) > keep:
                        cache.truncate(seq.seq_id, keep, [name])
        if self.proposer is not None:
            self.draft_counts.lap("other")
            self.proposer.on_step(StepFeedback(
                seqs, layout, num_accepted, output, tuple(s.seq_id for s in finished), preempted,
                cache_finished=self.prefix.enabled,
                dormant=frozenset(s.seq_id for s in seqs if self.draft_counts.is_dormant(s.seq_id)),
            ))
            self.draft_counts.lap("keep")
            if any(layout.num_drafts):
                self.spec_stats.observe(layout.num_drafts, num_accepted)
                if self.alarm is not None:
                    self.spec_stats.warnings += self.alarm.observe(layout.requests, layout.num_drafts, num_accepted)
        for seq in seqs:  # full, final pages become reusable (a finished request's too)
            self.prefix.publish(seq, drafting=not self.draft_counts.is_dormant(seq.seq_id))
        for seq, drafted, accepted in zip(seqs, layout.num_drafts, num_accepted):
            self.draft_counts.observe_verified(seq.seq_id, drafted, accepted)
        for seq in finished:
            self.draft_counts.forget(seq.seq_id, seq.num_output_tokens)
            if self.alarm is not None:
                self.alarm.forget(seq.seq_id)
        for seq in self.draft_counts.to_wake(seqs):
            self.scheduler.recompute(seq)  # a dormant request drafts again once recomputed
        for seq in finished:
            self.scheduler.finish(seq)
            cache.free(seq.seq_id)
            self.prefix.release(seq.seq_id)
        out = StepOutput(self.stats.num_steps, tuple(results))
        self.stats.num_steps += 1
        self.stats.num_forward_tokens += layout.num_rows
        self.stats.num_generated_tokens += generated
        return out
