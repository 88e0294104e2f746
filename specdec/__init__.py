"""specdec: pluggable speculative-decoding strategies for LLM inference."""

from specdec.llm import LLM
from specdec.outputs import RequestOutput
from specdec.sampling.params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "RequestOutput", "SamplingParams", "SpeculativeConfig"]


def __getattr__(name: str):
    # SpeculativeConfig lives with the proposers; imported on first use.
    if name == "SpeculativeConfig":
        from specdec.proposers.config import SpeculativeConfig

        return SpeculativeConfig
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
