"""``LLM``: the user-facing facade that builds an engine from a checkpoint folder and arguments."""

from __future__ import annotations

import atexit
from typing import Callable, Sequence

from specdec.engine.build import build_engine
from specdec.engine_args import EngineArgs
from specdec.output_processor import OutputProcessor
from specdec.outputs import RequestOutput, StepOutput
from specdec.sampling.params import SamplingParams
from specdec.tokenizer import encode


class LLM:
    """Generate from a Hugging Face-style checkpoint folder, optionally with speculative decoding.

    ``LLM(model, speculative_config=None, **kwargs)`` takes the fields of
    :class:`~specdec.engine_args.EngineArgs` as keywords (vLLM's names: ``attention_backend``,
    ``dtype``, ``block_size``, ``kv_cache_memory``, ``max_num_seqs``, ``max_model_len``, ``seed``), each
    validated before anything loads; :meth:`from_engine_args` takes a built ``EngineArgs``.
    With ``tensor_parallel_size > 1`` this process is rank 0 and starts the others
    (:mod:`specdec.engine.workers`); :meth:`close` stops them.
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
        self._workers = None
        if args.tensor_parallel_size > 1:
            from specdec.engine.workers import WorkerGroup, check_shards

            check_shards(args)  # a size that does not shard fails here, before any process starts
            self._workers = WorkerGroup(args)
            atexit.register(self.close)
        try:
            if self._workers is None:
                built = build_engine(args)
            else:
                built = build_engine(args, self._workers.group, on_step_failure=self._workers.step_failed)
        except BaseException:
            self.close()
            raise
        self.engine = built.engine
        self.tokenizer = built.tokenizer
        self.max_model_len = built.max_model_len
        self.engine_args = args
        self.speculative_config = args.speculative_config

    def close(self) -> None:
        """Stop the tensor-parallel workers (a no-op with one rank; also runs at interpreter exit)."""
        if self._workers is not None:
            atexit.unregister(self.close)  # the registration would keep this LLM alive until exit
            engine = getattr(self, "engine", None)
            self._workers.close(engine.sync if engine is not None else None)
            self._workers = None

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
