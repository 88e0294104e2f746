"""The project's own Triton kernels and the ``triton`` attention backend built on them.

Importing this package does not import Triton; the kernels load when a :class:`TritonBackend` is made.
"""

from __future__ import annotations

from specdec.backends.triton.backend import TritonBackend
from specdec.backends.triton.config import KernelConfig
from specdec.backends.triton.runtime import TritonUnavailableError

__all__ = ["KernelConfig", "TritonBackend", "TritonUnavailableError"]
