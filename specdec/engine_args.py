"""``EngineArgs``: every engine option, declared once for ``LLM``, the CLI commands and the benchmark.

Each field carries its validator (``specdec.validation``) and its command-line form in its metadata
(help text, metavar, how a flag's text becomes the value); :func:`add_cli_args` turns the fields of any
such attrs class into ``--kebab-case`` flags and :func:`cli_values` reads back the ones a user gave.
This module imports neither torch nor the models, so ``specdec --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any, Callable, Mapping

import attrs

from specdec.validation import boolean, int_at_least, is_int, non_empty_str, one_of, satisfies

DTYPE_NAMES = ("auto", "float32", "float64", "bfloat16", "float16")
# What KV pages store (specdec.cache.quant maps them to dtypes): "auto" = the model's dtype.
KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def byte_size(text: str) -> int:
    """``1048576``, ``64M``, ``2G``, ``512K`` (binary units) as bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([kKmMgGtT]?)i?[bB]?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a number of bytes like 67108864 or 64M, got {text!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[match.group(2).lower()]
    return int(match.group(1)) * scale


def arg(
    default: Any = attrs.NOTHING,
    *,
    validator=None,
    converter=None,
    help: str,  # noqa: A002 - argparse's word
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    flag: bool = True,
):
    """An option field: ``help`` (and ``metavar``) for its flag, ``parse`` turns the flag's text into the
    value (default: the field's type, str); a bool default makes it ``--name`` / ``--no-name``;
    ``flag=False`` keeps it off the command line."""
    metadata = {"help": help, "metavar": metavar, "parse": parse, "flag": flag,
                "boolean": isinstance(default, bool)}  # --name / --no-name
    return attrs.field(default=default, validator=validator, converter=converter, metadata=metadata)


def _path(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def to_speculative_config(value: Any):
    """None, or any accepted speculative-config form parsed (the field's converter)."""
    if value is None:
        return None
    from specdec.proposers.config import parse_speculative_config

    return parse_speculative_config(value)


def _dtype(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {value!r}; choose one of {list(DTYPE_NAMES)}")


@attrs.frozen(kw_only=True)
class EngineArgs:
    """How an engine is built (vLLM's names). ``LLM(model, **kwargs)`` takes these as keywords.

    - ``model``: folder with ``config.json`` and ``*.safetensors`` (and tokenizer files for text).
    - ``speculative_config``: None, ``"method:key=value,..."``, a JSON string, a dict or a
      ``SpeculativeConfig`` (parsed here, so a bad one fails before anything loads).
    - ``attention_backend``: ``"torch"``, ``"triton"``, ``"aiter"`` or a registered name.
    - ``dtype``: ``"auto"`` (the checkpoint's), ``"float32"``, ``"float64"``, ``"bfloat16"``, ``"float16"``.
    - ``block_size``: the target's KV page size; None = what the architecture and backend prefer.
    - ``kv_cache_dtype``: what the target's KV pages store: ``"auto"`` (the model's dtype), ``"fp8"`` /
      ``"fp8_e4m3"`` or ``"fp8_e5m2"`` (a byte a value, with a per-layer scale: half of bf16's memory).
    - ``draft_kv_cache_dtype``: the same for the draft's own pools; None = ``kv_cache_dtype``.
    - ``kv_cache_memory``: bytes for all KV pools together. None = room for ``max_num_seqs`` requests of
      ``max_model_len`` tokens, capped at a quarter of the memory available at start-up (but never
      below one full-length request).
    - ``max_num_seqs``: requests running at once.
    - ``max_model_len``: prompt + output tokens per request; None = the config's ``max_position_embeddings``.
    - ``max_num_batched_tokens``: query tokens per forward (prefill + decode + drafts); a longer prefill
      is split across steps (chunked prefill). None = no limit.
    - ``enable_prefix_caching``: reuse the KV pages of identical prompt prefixes across requests.
    - ``seed``: seeds requests that have no ``SamplingParams.seed`` (reproducible runs).
    - ``tensor_parallel_size``: ranks the weights and KV heads are split over; specdec starts the other
      ranks' processes itself, or joins the group ``torchrun`` started (see :mod:`specdec.distributed`).
      ``kv_cache_memory`` is per rank.
    - ``batch_invariant``: compute every row independently of the batch it is in
      (:mod:`specdec.backends.invariance`), so greedy outputs are bit-identical with and without
      speculation and at any concurrency, in any dtype; slower. ``torch`` and ``triton`` backends.
    """

    model: str = arg(validator=non_empty_str(), converter=_path, metavar="DIR",
                     help="checkpoint folder (config.json + *.safetensors)")
    speculative_config: Any = arg(None, converter=to_speculative_config, metavar="STR",
                                  help="'method:key=value,...' or a JSON object; methods: ngram, draft_model, eagle3, "
                                       "... (default: none)")
    attention_backend: str = arg("torch", validator=non_empty_str(), metavar="NAME",
                                 help="torch | triton | aiter (default: torch)")
    dtype: str = arg("auto", validator=_dtype, metavar="NAME",
                     help="auto | float32 | float64 | bfloat16 | float16 (default: auto)")
    block_size: int | None = arg(None, validator=int_at_least(1, optional=True), metavar="N", parse=int,
                                 help="target KV page size (default: the model's/backend's)")
    kv_cache_dtype: str = arg("auto", validator=one_of(KV_CACHE_DTYPE_NAMES), metavar="NAME",
                              help="what the target's KV pages store: auto (the model's dtype) | fp8 | fp8_e4m3 | "
                                   "fp8_e5m2 (default: auto)")
    draft_kv_cache_dtype: str | None = arg(None, validator=one_of(KV_CACHE_DTYPE_NAMES, optional=True), metavar="NAME",
                                           help="what the draft's own KV pages store (default: --kv-cache-dtype)")
    kv_cache_memory: int | None = arg(None, validator=int_at_least(1, optional=True), metavar="BYTES",
                                      parse=byte_size, help="bytes for all KV pools, e.g. 67108864 or 64M")
    max_num_seqs: int = arg(256, validator=int_at_least(1), metavar="N", parse=int,
                            help="requests running at once (default: 256)")
    max_model_len: int | None = arg(None, validator=int_at_least(2, optional=True), metavar="N", parse=int,
                                    help="prompt + output tokens per request (default: the model's)")
    max_num_batched_tokens: int | None = arg(None, validator=int_at_least(1, optional=True), metavar="N", parse=int,
                                             help="query tokens per forward; a longer prefill is split across "
                                                  "steps (chunked prefill; default: no limit)")
    enable_prefix_caching: bool = arg(True, validator=boolean(),
                                      help="reuse KV pages of identical prompt prefixes across requests "
                                           "(default: on)")
    seed: int = arg(0, validator=satisfies(is_int, "an int"), metavar="S", parse=int,
                    help="seed of the run's sampling (default: 0)")
    tensor_parallel_size: int = arg(1, validator=int_at_least(1), metavar="N", parse=int,
                                    help="processes the model's weights and KV heads are split over "
                                         "(torch.distributed; default: 1)")
    batch_invariant: bool = arg(False, validator=boolean(),
                                help="batch-invariant numerics: each row computed independently of what it is batched "
                                     "with, so outputs are identical with and without speculation and at any "
                                     "concurrency (slower; default: off)")

    @classmethod
    def from_kwargs(cls, where: str, **kwargs: Any) -> "EngineArgs":
        """``cls(**kwargs)``, with an unknown keyword reported as ``ValueError`` listing the valid ones."""
        names = attrs.fields_dict(cls)
        unknown = [k for k in kwargs if k not in names]
        if unknown:
            raise ValueError(f"{where} got an unknown argument {unknown[0]!r}; valid: {', '.join(names)}")
        return cls(**kwargs)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_cli_args(
    parser: argparse.ArgumentParser | Any,
    config_class: type,
    *,
    only: tuple[str, ...] | None = None,
    skip: tuple[str, ...] = (),
) -> None:
    """One flag per field of ``config_class`` (``--kebab-case``; just ``only`` if given, not ``skip``),
    defaulting to "not given".

    A flag the user leaves out is absent from the parsed namespace, so the class's own default
    applies (see :func:`cli_values`); help texts come from the fields.
    """
    for field in attrs.fields(config_class):
        meta = field.metadata
        if field.name in skip or (only is not None and field.name not in only) or not meta.get("flag", False):
            continue
        kwargs: dict[str, Any] = {"help": meta["help"], "default": argparse.SUPPRESS, "dest": field.name}
        if meta.get("boolean"):
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["metavar"] = meta.get("metavar")
            kwargs["type"] = meta.get("parse") or str
        if field.default is attrs.NOTHING and not meta.get("boolean"):
            kwargs["required"] = True
        parser.add_argument(flag_name(field.name), **kwargs)


def cli_values(namespace: argparse.Namespace, config_class: type) -> dict[str, Any]:
    """The fields of ``config_class`` the user gave on the command line."""
    given = vars(namespace)
    return {f.name: given[f.name] for f in attrs.fields(config_class) if f.name in given}


def engine_fields(config: Any) -> Mapping[str, Any]:
    """The :class:`EngineArgs` fields of ``config`` (an ``EngineArgs`` or a subclass), as keywords."""
    return {name: getattr(config, name) for name in attrs.fields_dict(EngineArgs)}


def label_with_flag(name: str) -> str:
    """``"concurrency (--concurrency)"``: errors of command-line configs name the flag too."""
    return f"{name} ({flag_name(name)})"
