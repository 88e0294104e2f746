"""``BenchConfig``: the engine's options (``EngineArgs``, declared once) plus the benchmark's workload."""

from __future__ import annotations

import argparse
from typing import Any

import attrs

from specdec.engine_args import EngineArgs, arg, engine_fields, label_with_flag, to_speculative_config
from specdec.bench.workload import PROMPT_SOURCES, WORKLOADS
from specdec.validation import int_at_least, is_real, non_empty_str, one_of, satisfies


def parse_temperatures(text: str) -> tuple[float, ...]:
    """``--temperature``'s text: one temperature or a comma list (``"0,0.7"``)."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a temperature or a comma list of them like 0 or 0,0.7, got {text!r}") from None


def _to_temperatures(value: Any) -> Any:
    """A number or a sequence of numbers as a tuple (anything else is left for the validator to refuse)."""
    if is_real(value):
        return (value,)
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _temperatures_ok(value: Any) -> bool:
    return (isinstance(value, tuple) and bool(value) and all(is_real(t) and t >= 0 for t in value)
            and len(set(value)) == len(value))


@attrs.frozen(kw_only=True)
class BenchConfig(EngineArgs):
    """One benchmark: the engine's settings (every ``EngineArgs`` field) and the workload.

    - ``speculative_config``: the spec run's config (any ``LLM`` form); None runs the baseline only.
    - Workload (:mod:`specdec.bench.workload`): ``workload`` ``"single"`` runs ``dataset`` (a JSONL
      file of ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` lines; its first ``num_prompts``
      lines, all when None) or, without one, ``num_prompts`` (default 16) prompts of ``input_len``
      tokens from ``prompt_source``. ``"shared-prefix"``: ``num_prompts`` requests, each one of
      ``num_prefixes`` system prompts of ``prefix_len`` tokens + a user suffix of ``input_len``; ``"multi-turn"``:
      ``num_prompts`` conversations of ``num_turns`` turns, each turn's prompt the previous turn's
      prompt + its output + a user message of ``input_len``. Every request generates ``output_len``
      tokens (``ignore_eos``), or, with ``output_spread`` r > 0, a length drawn once per request
      (conversation: for all its turns) uniformly from ``output_len`` x [1 - r, 1 + r] with ``seed``,
      the same draw for every run (vLLM's ``--random-range-ratio``, for outputs): with equal lengths,
      requests without speculation finish in lockstep and the next ones' prompts run in one large
      forward, which no real load gives.
    - ``prompt_source``: where prompts come from without a ``dataset``: ``"held-out"`` (the default
      when the model folder has a tokenizer: text no zoo model trained on, see
      :mod:`specdec.bench.workload`) or ``"synthetic"`` (ids drawn uniformly from the vocabulary
      with ``seed``; the default without a tokenizer). None = the default.
    - ``temperature``: one or more temperatures (a number or a sequence; 0 = greedy); the baseline
      and the spec run are repeated at each, each run on a fresh engine.
    - ``concurrency``: requests in flight at most; ``warmup``: uncounted requests run first.
    - Two engine defaults differ, to keep the default KV budget small: ``max_num_seqs`` None =
      ``concurrency``; ``max_model_len`` None = the longest prompt + ``output_len``.
    - ``base_url``: run over HTTP against that server (``specdec bench``'s ``--base-url``), with
      ``baseline_url`` as the baseline if given; the engine options are then the servers'.
    """

    def __attrs_post_init__(self) -> None:
        if self.baseline_url is not None and self.base_url is None:
            raise ValueError("baseline_url (--baseline-url) needs base_url (--base-url): the server to compare")
        if self.dataset is not None and self.workload != "single":
            raise ValueError(f"dataset (--dataset) gives the single workload's prompts; --workload {self.workload} "
                             "draws its own (see --prompt-source)")
        if self.dataset is not None and self.prompt_source is not None:
            raise ValueError("dataset (--dataset) and prompt_source (--prompt-source) both say where the prompts "
                             "come from; give one")

    speculative_config: Any = arg(None, converter=to_speculative_config,
                                  metavar="STR", help="the spec run's config, 'method:key=value,...' or JSON "
                                                      "(default: baseline only)")
    max_num_seqs: int | None = arg(None, validator=int_at_least(1, optional=True), metavar="N", parse=int,
                                   help="engine's running requests (default: --concurrency)")
    max_model_len: int | None = arg(None, validator=int_at_least(2, optional=True), metavar="N", parse=int,
                                    help="prompt + output tokens per request (default: longest prompt + --output-len)")
    workload: str = arg("single", validator=one_of(WORKLOADS), metavar="|".join(WORKLOADS),
                        help="single: independent prompts (--dataset's, or --prompt-source's); shared-prefix: "
                             "requests over --num-prefixes system prompts; multi-turn: conversations, each turn "
                             "extending the last one's prompt and output (default: single)")
    dataset: str | None = arg(None, metavar="FILE.jsonl",
                              help='single workload\'s prompts, one {"prompt": str} or {"prompt_token_ids": [...]} '
                                   "a line (default: --prompt-source's)")
    prompt_source: str | None = arg(None, validator=one_of(PROMPT_SOURCES, optional=True),
                                    metavar="|".join(PROMPT_SOURCES),
                                    help="without --dataset, where prompts come from: held-out: windows of text no "
                                         "zoo model trained on (the training corpus's validation split: Python "
                                         "stdlib files and pydoc topics of the running interpreter); synthetic: "
                                         "token ids drawn uniformly from the vocabulary (default: held-out, "
                                         "synthetic for a model folder without a tokenizer)")
    num_prompts: int | None = arg(None, validator=int_at_least(1, optional=True), metavar="N", parse=int,
                                  help="requests to run, conversations with multi-turn (default: 16, or the whole "
                                       "dataset)")
    input_len: int = arg(64, validator=int_at_least(1), metavar="N", parse=int,
                         help="tokens of a single prompt (without --dataset), a shared-prefix user suffix or a "
                              "multi-turn user message (default: 64)")
    prefix_len: int = arg(256, validator=int_at_least(1), metavar="N", parse=int,
                          help="shared-prefix: tokens of each system prompt (default: 256)")
    num_prefixes: int = arg(4, validator=int_at_least(1), metavar="N", parse=int,
                            help="shared-prefix: system prompts the requests share (default: 4)")
    num_turns: int = arg(3, validator=int_at_least(2), metavar="N", parse=int,
                         help="multi-turn: turns per conversation (default: 3)")
    output_len: int = arg(64, validator=int_at_least(1), metavar="N", parse=int,
                          help="tokens generated per request (default: 64)")
    output_spread: float = arg(0.0, validator=satisfies(lambda v: is_real(v) and 0 <= v < 1, "a number in [0, 1)"),
                               metavar="R", parse=float,
                               help="draw each request's output length uniformly within R x --output-len of it, "
                                    "the same draw for every run (vLLM's --random-range-ratio, for outputs; "
                                    "default: 0, every request --output-len)")
    concurrency: int = arg(4, validator=int_at_least(1), metavar="N", parse=int,
                           help="requests in flight at most (default: 4)")
    warmup: int = arg(1, validator=int_at_least(0), metavar="N", parse=int,
                      help="uncounted requests run first (default: 1)")
    temperature: tuple[float, ...] = arg(
        (0.0,), converter=_to_temperatures, metavar="T[,T...]", parse=parse_temperatures,
        validator=satisfies(_temperatures_ok, "numbers >= 0, each once, like 0 or 0,0.7"),
        help="sampling temperature, or a comma list to run each (e.g. 0,0.7: greedy and sampled rows); "
             "0 = greedy (default: 0)")
    base_url: str | None = arg(None, validator=non_empty_str(optional=True), metavar="URL",
                               help="drive a running server (specdec serve) over HTTP instead of an in-process "
                                    "engine; --model still gives the prompts' tokenizer")
    baseline_url: str | None = arg(None, validator=non_empty_str(optional=True), metavar="URL",
                                   help="with --base-url: a server without speculation to compare with")

    @classmethod
    def _field_label(cls, name: str) -> str:
        return label_with_flag(name)

    def engine_args(self, speculative_config: Any, max_model_len: int) -> EngineArgs:
        """The ``EngineArgs`` of one run (the baseline passes ``speculative_config=None``)."""
        fields = dict(engine_fields(self))
        fields.update(speculative_config=speculative_config, max_model_len=max_model_len,
                      max_num_seqs=self.max_num_seqs or self.concurrency)
        return EngineArgs(**fields)
