"""Building an engine from :class:`~specdec.engine_args.EngineArgs`: what ``LLM`` and every
tensor-parallel worker do, each on its own rank of the current group."""

from __future__ import annotations

import os
from typing import Any

import attrs

from specdec.backends import get_backend
from specdec.cache.paged_cache import PagedKVCache
from specdec.distributed import parallel_state as ps
from specdec.distributed.step_sync import StepSync
from specdec.engine.acceptance_alarm import AcceptanceAlarm, DraftExpectation
from specdec.engine.engine import LLMEngine
from specdec.models.base import config_max_len
from specdec.engine.pools import register_pools
from specdec.engine.scheduler import Scheduler, SchedulerConfig
from specdec.engine_args import EngineArgs
from specdec.models.loader import load_model
from specdec.proposers import load_warnings
from specdec.proposers.draft_record import check_target
from specdec.proposers.registry import create_proposer
from specdec.tokenizer import load_tokenizer

# The default KV budget never takes more than this share of the memory available at start-up.
DEFAULT_MEMORY_FRACTION = 0.25


@attrs.frozen
class BuiltEngine:
    """An engine ready to step, with the tokenizer of its model folder (None without one)."""

    engine: LLMEngine
    tokenizer: Any
    max_model_len: int


def build_engine(
    args: EngineArgs, group: ps.TensorParallelGroup = ps.SINGLE, on_step_failure=None
) -> BuiltEngine:
    """Load the target and the proposer's draft (this rank's shards of ``group``), size the KV cache
    and build the engine. Under tensor parallelism every rank calls this with the same ``args``; the
    ranks agree on the default KV budget (the smallest any of them can afford). ``on_step_failure``:
    see :class:`~specdec.distributed.step_sync.StepSync`."""
    # What loading the draft finds suspicious (warnings, not errors) goes to the engine's spec_stats.
    with ps.using(group), load_warnings.collecting() as found:
        return _build(args, group, on_step_failure, found)


def _build(args: EngineArgs, tp: ps.TensorParallelGroup, on_step_failure, load_warnings_found) -> BuiltEngine:
    backend = get_backend(args.attention_backend)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                          max_num_batched_tokens=args.max_num_batched_tokens))
    target = load_model(args.model, dtype=args.dtype)
    max_model_len = _max_model_len(target, args.max_model_len)
    spec = args.speculative_config
    proposer = create_proposer(spec) if spec is not None else None

    # Registered before the budget is fixed, so the default can be sized from the real pools.
    cache = PagedKVCache(args.kv_cache_memory or 1)
    pools = register_pools(target, cache, backend, proposer, block_size=args.block_size, max_model_len=max_model_len,
                           kv_cache_dtype=args.kv_cache_dtype, draft_kv_cache_dtype=args.draft_kv_cache_dtype)
    alarm, recorded = None, None
    if spec is not None and spec.model:  # a draft made by a model should accept (ngram's rate is the text's)
        check_target(spec.model, args.model)
        expectation = DraftExpectation.for_draft(spec.method, spec.model, load_warnings_found)
        recorded = expectation.recorded  # every rank's adaptive controller starts from it alike
        if tp.rank == 0:
            alarm = AcceptanceAlarm(expectation)
    if args.kv_cache_memory is None:
        cache.memory_budget = ps.min_over_ranks(tp, default_kv_cache_memory(cache, args.max_num_seqs, max_model_len))
    engine = LLMEngine(
        target,
        cache,
        backend,
        scheduler=scheduler,
        proposer=proposer,
        max_model_len=max_model_len,
        eos_token_ids=_eos_ids(target.hf_config),
        seed=args.seed,
        pools=pools,
        enable_prefix_caching=args.enable_prefix_caching,
        sync=StepSync(tp, on_step_failure) if tp.size > 1 else None,
        adaptive=bool(spec is not None and spec.adaptive),
        recorded_acceptance=recorded,
        batch_invariant=args.batch_invariant,
        acceptance_alarm=alarm,
    )
    return BuiltEngine(engine, load_tokenizer(args.model), max_model_len)


def default_kv_cache_memory(cache: PagedKVCache, max_num_seqs: int, max_model_len: int) -> int:
    """Bytes for ``max_num_seqs`` full-length requests in the registered pools, capped (see ``LLM``)."""
    # Whole pages per request: with 128-token pages and short requests, tokens alone undercount.
    full = cache.bytes_needed(max_model_len) * max_num_seqs
    cap = int(_available_memory() * DEFAULT_MEMORY_FRACTION / ps.current().size)
    return max(min(full, cap), cache.bytes_needed(max_model_len))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _max_model_len(model, requested: int | None) -> int:
    if requested is None:
        return config_max_len(model)
    limit = getattr(model.hf_config, "max_position_embeddings", None)
    if limit and requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's max_position_embeddings ({limit}); lower it"
        )
    return requested


def _eos_ids(hf_config) -> tuple[int, ...]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(t) for t in eos)
