"""Batch-invariant numerics: every row's result independent of how many rows share the call, and which.

A float reduction's result depends on its order. CPU and GPU kernels choose the order from the shape
of the whole call: a GEMM over one row runs a matrix-vector kernel, over a few rows a tiled one
whose inner-dimension split follows the row count; attention over a padded batch sums a row's keys in
lanes set by the batch's longest request; an elementwise ``sigmoid`` computes the last few elements of
a tensor (or of a thread's share) with a scalar routine that rounds differently from the vector one.
So the same request decodes one token alone, inside a batch of 16, or as a row of a (k+1)-row verify
with different last bits, and a near-tie between two logits can flip the greedy token.

Under :func:`batch_invariant` the ops on the serving path take a reduction order fixed by the row
alone (what the engine enters around each step with ``batch_invariant=True``):

- GEMMs (linear layers, the LM head, MoE experts, MLA's absorbed maps) run over rows in fixed blocks
  of :data:`ROW_BLOCK` rows, the last one padded with zero rows (:func:`in_row_blocks`): every call
  has the same shape, so the kernel and its split of the inner dimension are the same for every row.
- Attention sums each query's keys in fixed splits of :data:`KEY_SPLIT` positions from position 0,
  merged in split order (:mod:`specdec.backends.fixed_split`); splits past a query's keys merge as
  exact no-ops, so padding and companions change nothing.
- ``sigmoid`` and ``silu`` are built from ops whose scalar and vector routines agree (``exp``, add,
  divide), so an element's position in the tensor no longer matters.

Everything else on the path (RMSNorm's row mean, RoPE, softmax and the sampler's per-row work, top-k,
argmax) is already row-invariant: ``tests/models/test_batch_invariance.py`` checks each op, one row
alone against the same row in batches of 2..64 rows, bit for bit.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

# Rows per GEMM call in the mode. A row's result depends on the block size, so it is one constant. Zoo
# MiniMax-M3 pair, bf16, 1 thread, output tok/s with 8 / 16 / 32-row blocks: eagle3 at concurrency 1
# 79 / 80 / 62, plain at concurrency 16 218 / 277 / 313 (a decode pads 1 row to a block; a large
# batch pays a call, and a read of the weights, per block).
ROW_BLOCK = 16
# Key positions per attention split in the mode (a multiple of every vector width).
KEY_SPLIT = 64

_ENABLED: contextvars.ContextVar[bool] = contextvars.ContextVar("specdec_batch_invariant", default=False)


def enabled() -> bool:
    """Whether the current context runs batch-invariant numerics."""
    return _ENABLED.get()


@contextlib.contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Run the enclosed ops batch-invariantly (``on=False``: as fast as they come), in this context
    only (a context variable: other threads and tasks keep their own setting)."""
    token = _ENABLED.set(bool(on))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def in_row_blocks(fn: Callable[..., torch.Tensor], *xs: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """``fn(*xs)`` computed over the rows (dim 0) of ``xs`` in calls of exactly ``block`` rows (default
    :data:`ROW_BLOCK`), the last block padded with zero rows; ``fn`` must treat rows independently (a
    GEMM, a batched GEMM).

    Every call sees contiguous operands of one shape and layout (a kernel may choose by strides too)."""
    block = block or ROW_BLOCK
    rows = xs[0].shape[0]
    if rows == 0:
        return fn(*xs)
    xs = tuple(x.contiguous() for x in xs)
    full, tail = divmod(rows, block)
    parts = [fn(*(x[i * block : (i + 1) * block] for x in xs)) for i in range(full)]
    if tail:
        padded = []
        for x in xs:
            last = x.new_zeros((block, *x.shape[1:]))
            last[:tail] = x[full * block :]
            padded.append(last)
        parts.append(fn(*padded)[:tail])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _work(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``torch.sigmoid``; in the mode ``1 / (1 + exp(-x))`` in at least float32, rounded once (torch's
    own sigmoid rounds its scalar tail differently from its vector body)."""
    if not enabled():
        return torch.sigmoid(x)
    return torch.reciprocal(torch.exp(-_work(x)).add_(1.0)).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``F.silu``; in the mode ``x * sigmoid(x)`` from :func:`sigmoid`'s ops, rounded once."""
    if not enabled():
        return F.silu(x)
    work = _work(x)
    return (work * torch.reciprocal(torch.exp(-work).add_(1.0))).to(x.dtype)
