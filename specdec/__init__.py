"""specdec: pluggable speculative-decoding strategies for LLM inference."""

__version__ = "0.1.0"
