"""``specdec serve``'s arguments: the engine's (``EngineArgs``), the server's, and vLLM's spellings.

Operators start specdec with the command lines they use for ``vllm serve``, so:

- ``--speculative-config`` takes a JSON object or a config string, and the dotted form the seeds write
  (``--speculative-config.method eagle3 --speculative-config.num_speculative_tokens 3``) builds the
  same dict, each value read as JSON where it parses (``3`` an int, ``true`` a bool), else as a string;
- flag names may use ``_`` for ``-`` (``--gpu_memory_utilization``), as vLLM allows;
- vLLM flags that mean nothing here are accepted with one warning line each saying what specdec does
  instead (:data:`VLLM_ONLY`); an unknown flag is one error line.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Sequence

import attrs

from specdec.engine_args import EngineArgs, add_cli_args, arg, cli_values, label_with_flag
from specdec.validation import boolean, int_at_least, int_in_range, non_empty_str, one_of

# vLLM flag -> (takes a value, what specdec does instead).
VLLM_ONLY: dict[str, tuple[bool, str]] = {
    "--gpu-memory-utilization": (True, "the KV cache is sized by --kv-cache-memory (bytes), not a share of the device"),
    "--compilation-config": (True, "models run eagerly; there is nothing to compile"),
    "--trust-remote-code": (False, "specdec runs its own implementation of each architecture; no remote code"),
    "--no-trust-remote-code": (False, "specdec runs its own implementation of each architecture; no remote code"),
    "--async-scheduling": (False, "the engine steps in its own process while the server handles requests"),
    "--enable-auto-tool-choice": (False, "tool calls are not parsed; messages are served as text"),
    "--tool-call-parser": (True, "tool calls are not parsed; messages are served as text"),
    "--reasoning-parser": (True, "reasoning is not separated from the answer; it is served as text"),
    "--language-model-only": (False, "only language models are served"),
    "--additional-config": (True, "no platform plug-in reads it"),
    "--disable-log-requests": (False, "requests are not logged"),
    "--disable-log-stats": (False, "the periodic stats line stays on"),
}
SPEC_PREFIX = "--speculative-config."


@attrs.frozen(kw_only=True)
class ServerArgs(EngineArgs):
    """The engine's options plus the server's own (vLLM's names)."""

    host: str = arg("127.0.0.1", validator=non_empty_str(), metavar="HOST",
                    help="address to listen on (default: 127.0.0.1)")
    port: int = arg(8000, validator=int_in_range(0, 65536, what="a port number 0..65535"), metavar="PORT",
                    parse=int, help="port to listen on (default: 8000)")
    served_model_name: str | None = arg(None, validator=non_empty_str(optional=True), metavar="NAME",
                                        help="the model's name in requests (default: MODEL as given)")
    api_key: str | None = arg(None, validator=non_empty_str(optional=True), metavar="KEY",
                              help="require 'Authorization: Bearer KEY' on /v1 routes")
    max_waiting_requests: int = arg(1024, validator=int_at_least(1), metavar="N", parse=int,
                                    help="requests queued or running at most; more get 503 (default: 1024)")
    per_request_spec_decode_metrics: str | None = arg(
        None, validator=one_of(("summary", "detailed"), optional=True), metavar="summary|detailed",
        help="add each response's own speculative figures to it (a request can also ask: spec_decode_metrics)")
    stats_interval: float = arg(5.0, metavar="S", parse=float,
                                help="seconds between stats log lines while busy (default: 5)")
    engine_process: bool = arg(True, validator=boolean(),
                               help="step the engine in a process of its own, so HTTP work never holds its "
                                    "interpreter lock (default); --no-engine-process steps it in a thread of "
                                    "the server's process (to look inside it, or for proposers registered in code)")

    @classmethod
    def _field_label(cls, name: str) -> str:
        return label_with_flag(name)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


class ServerArgsError(ValueError):
    """A command line ``specdec serve`` cannot start with; the message is one line."""


def _normalise(argv: Sequence[str]) -> list[str]:
    """``--flag_name`` spelled ``--flag-name`` (the part before any ``=`` or ``.``)."""
    out = []
    for item in argv:
        if item.startswith("--"):
            name, sep, value = item.partition("=")
            head, dot, tail = name.partition(".")
            item = head.replace("_", "-") + dot + tail + sep + value
        out.append(item)
    return out


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def split_vllm_flags(argv: Sequence[str]) -> tuple[list[str], dict[str, Any], list[str]]:
    """Take the dotted speculative-config keys and the vLLM-only flags out of ``argv``.

    Returns the remaining arguments, the dotted keys as a dict, and one warning line per vLLM-only
    flag. Raises :class:`ServerArgsError` for a flag without its value or a refused value.
    """
    rest, spec, warnings = [], {}, []
    items = _normalise(argv)
    i = 0
    while i < len(items):
        name, eq, inline = items[i].partition("=")
        dotted = name.startswith(SPEC_PREFIX)
        if not dotted and name not in VLLM_ONLY:
            rest.append(items[i])
            i += 1
            continue
        value = None
        if dotted or VLLM_ONLY[name][0]:
            if eq:
                value, i = inline, i + 1
            elif i + 1 < len(items):
                value, i = items[i + 1], i + 2
            else:
                raise ServerArgsError(f"{name} needs a value")
        else:
            i += 1
        if dotted:
            spec[name[len(SPEC_PREFIX):]] = _json_or_text(value)
            continue
        instead = VLLM_ONLY[name][1]
        shown = name if value is None else f"{name} {value}"
        warnings.append(f"warning: {shown} is a vLLM flag that specdec ignores: {instead}")
    return rest, spec, warnings


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Fill ``parser`` (``specdec serve``'s) with MODEL and one flag per ServerArgs field."""
    parser.add_argument("model", metavar="MODEL", help="checkpoint folder (config.json + *.safetensors)")
    add_cli_args(parser.add_argument_group("engine"), ServerArgs, skip=("model",),
                 only=tuple(attrs.fields_dict(EngineArgs)))
    add_cli_args(parser.add_argument_group("server"), ServerArgs, skip=tuple(attrs.fields_dict(EngineArgs)))
    return parser


def parse_server_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[ServerArgs, list[str]]:
    """The ServerArgs of a ``specdec serve`` command line, and the warning lines to print."""
    rest, dotted, warnings = split_vllm_flags(argv)
    namespace = parser.parse_args(rest)
    values = cli_values(namespace, ServerArgs)
    values["model"] = namespace.model
    if dotted:
        if values.get("speculative_config") is not None:
            raise ServerArgsError("give the speculative config once: --speculative-config JSON or the "
                                  "--speculative-config.KEY VALUE form, not both")
        values["speculative_config"] = dotted
    return ServerArgs(**values), warnings
