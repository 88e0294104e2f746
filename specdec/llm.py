"""``LLM``: the user-facing facade that builds an engine from a checkpoint folder and arguments."""

from __future__ import annotations

import os
from typing import Callable, Sequence

from specdec.backends import get_backend
from specdec.cache.paged_cache import PagedKVCache
from specdec.engine.engine import LLMEngine, config_max_len
from specdec.engine.pools import register_pools
from specdec.engine.scheduler import Scheduler, SchedulerConfig
from specdec.engine_args import EngineArgs
from specdec.models.loader import load_model
from specdec.output_processor import OutputProcessor
from specdec.outputs import RequestOutput, StepOutput
from specdec.proposers.registry import create_proposer
from specdec.sampling.params import SamplingParams
from specdec.tokenizer import encode, load_tokenizer

# The default KV budget never takes more than this share of the memory available at start-up.
DEFAULT_MEMORY_FRACTION = 0.25


class LLM:
    """Generate from a Hugging Face-style checkpoint folder, optionally with speculative decoding.

    ``LLM(model, speculative_config=None, **kwargs)`` takes the fields of
    :class:`~specdec.engine_args.EngineArgs` as keywords (vLLM's names: ``attention_backend``,
    ``dtype``, ``block_size``, ``kv_cache_memory``, ``max_num_seqs``, ``max_model_len``, ``seed``), each
    validated before anything loads; :meth:`from_engine_args` takes a built ``EngineArgs``.
    """

    def __init__(self, model: str, speculative_config=None, **kwargs):
        args = EngineArgs.from_kwargs("LLM", model=model, speculative_config=speculative_config, **kwargs)
        self._build(args)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLM":
        llm = cls.__new__(cls)
        llm._build(args)
        return llm

    def _build(self, args: EngineArgs) -> None:
        backend = get_backend(args.attention_backend)
        scheduler = Scheduler(SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                              max_num_batched_tokens=args.max_num_batched_tokens))
        target = load_model(args.model, dtype=args.dtype)
        self.max_model_len = _max_model_len(target, args.max_model_len)
        self.tokenizer = load_tokenizer(args.model)
        spec = args.speculative_config
        proposer = create_proposer(spec) if spec is not None else None

        # Registered before the budget is fixed, so the default can be sized from the real pools.
        cache = PagedKVCache(args.kv_cache_memory or 1)
        pools = register_pools(
            target, cache, backend, proposer, block_size=args.block_size, max_model_len=self.max_model_len
        )
        if args.kv_cache_memory is None:
            cache.memory_budget = default_kv_cache_memory(cache, args.max_num_seqs, self.max_model_len)
        self.engine = LLMEngine(
            target,
            cache,
            backend,
            scheduler=scheduler,
            proposer=proposer,
            max_model_len=self.max_model_len,
            eos_token_ids=_eos_ids(target.hf_config),
            seed=args.seed,
            pools=pools,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        self.engine_args = args
        self.speculative_config = spec

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        on_step: Callable[[StepOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in input order.

        ``prompts`` are strings (needs a tokenizer in the model folder) or lists of token ids.
        ``sampling_params`` is one ``SamplingParams`` for all, a list with one per prompt, or None
        (the defaults). ``use_tqdm``: a progress bar; None = only when stderr is a terminal.
        ``on_step``: called with every engine step's :class:`~specdec.outputs.StepOutput` (per request:
        the tokens it emitted, its drafts and how many were accepted), e.g. to trace acceptance.
        Stop strings (``SamplingParams.stop``) are matched on the decoded text.
        Every request is checked before any runs; one that can never fit the KV cache raises
        ``ValueError`` naming ``kv_cache_memory``.
        """
        if isinstance(prompts, (str, bytes)):
            raise ValueError("prompts must be a list (of strings or of token-id lists), not a single string")
        prompts = list(prompts)
        ids = [self._prompt_ids(p, i) for i, p in enumerate(prompts)]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(ids)
        else:
            params = list(sampling_params)
        if len(params) != len(ids):
            raise ValueError(f"got {len(params)} SamplingParams for {len(ids)} prompts; pass one or one per prompt")
        seqs = [self.engine.make_sequence(p, sp, index=i) for i, (p, sp) in enumerate(zip(ids, params))]
        processor = OutputProcessor(self.tokenizer)
        states = [processor.add(seq.seq_id, seq.index, p, seq.params) for seq, p in zip(seqs, ids)]

        def observe(out: StepOutput) -> None:
            for request in processor.process(out):
                self.engine.abort(request, "stop")
            if on_step is not None:
                on_step(out)

        self.engine.run(seqs, use_tqdm=use_tqdm, on_step=observe)
        return [state.output() for state in states]

    def spec_stats(self):
        """Speculation counters since construction or :meth:`reset_spec_stats`; None without speculation."""
        return self.engine.spec_stats

    def prefix_cache_stats(self) -> dict:
        """``{"queries", "hits", "hit_rate"}``: prompt tokens looked up in the prefix cache since
        construction, and how many were found there (vLLM's ``prefix_cache_queries`` / ``_hits``)."""
        return self.engine.prefix_cache_stats().as_dict()

    def reset_spec_stats(self) -> None:
        if self.engine.spec_stats is not None:
            self.engine.spec_stats.reset()

    def _prompt_ids(self, prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"prompt {index} is text but the model folder has no tokenizer files; pass token ids instead"
                )
            return encode(self.tokenizer, prompt)
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise ValueError(f"prompt {index} must be a string or a list of token ids, got {type(prompt).__name__}")


def default_kv_cache_memory(cache: PagedKVCache, max_num_seqs: int, max_model_len: int) -> int:
    """Bytes for ``max_num_seqs`` full-length requests in the registered pools, capped (see ``LLM``)."""
    # Whole pages per request: with 128-token pages and short requests, tokens alone undercount.
    full = cache.bytes_needed(max_model_len) * max_num_seqs
    cap = int(_available_memory() * DEFAULT_MEMORY_FRACTION)
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
