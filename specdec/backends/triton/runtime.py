"""Where the project's Triton kernels can run: a GPU, or the CPU under Triton's interpreter."""

from __future__ import annotations

import os

import torch


class TritonUnavailableError(RuntimeError):
    """The Triton kernels cannot run in this process (no GPU and no interpreter)."""


def interpreter_requested() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the interpreter (read the way Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def kernels_interpreted() -> bool:
    """Whether the kernel modules were decorated in interpreter mode.

    Triton decides at ``@triton.jit`` time, so this is fixed once :mod:`.kernels` is imported; flipping
    the environment variable afterwards changes nothing.
    """
    from specdec.backends.triton import kernels

    return kernels.INTERPRETED


def check_runnable() -> None:
    """Raise a one-line :class:`TritonUnavailableError` unless a GPU or the interpreter is available."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton is a hard dependency
        raise TritonUnavailableError(f"attention backend 'triton' needs the triton package: {exc}") from None
    if not torch.cuda.is_available() and not interpreter_requested():
        raise TritonUnavailableError(
            "attention backend 'triton' needs a GPU; on a CPU set TRITON_INTERPRET=1 before the first "
            "import of specdec's triton kernels (slow, for tests), or use attention_backend='torch'"
        )


def check_device(tensor: torch.Tensor) -> None:
    """Kernels compiled for a GPU cannot touch CPU tensors; say so instead of crashing in a launch."""
    if tensor.device.type == "cpu" and not kernels_interpreted():
        raise TritonUnavailableError(
            "attention backend 'triton' got CPU tensors but its kernels were compiled for a GPU; move the "
            "model to the GPU, or set TRITON_INTERPRET=1 before specdec's triton kernels are first imported"
        )
