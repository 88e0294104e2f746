"""specdec: pluggable speculative-decoding strategies for LLM inference.

The public names are imported on first use, so ``specdec --help`` and light tools do not pay for
importing torch and transformers.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "specdec.llm",
    "RequestOutput": "specdec.outputs",
    "SamplingParams": "specdec.sampling.params",
    "SpeculativeConfig": "specdec.proposers.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
