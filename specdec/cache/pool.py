"""KV pools: the paged tensors of a set of layers that share one layout and one page size."""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Mapping, Protocol, runtime_checkable

import torch

from specdec.cache.quant import dequantize, is_fp8, quantize


@runtime_checkable
class KVPool(Protocol):
    """What the composable cache, the models and the proposers need from a pool.

    A pool stores, for each of its layers, one or more *entries* (``"k"`` and ``"v"`` for attention,
    ``"latent"`` for MLA, or anything a model needs, such as an indexer's keys), each a tensor of
    shape ``[num_blocks, block_size, *entry_shape]``. Pools are independent: each has its own page
    size, dtype and allocator, and request positions are mapped to pages per pool. A pool is
    described first (layers can still be added) and gets its tensors once the cache splits its budget.
    """

    name: str
    # The layout: "attention" (K/V heads), "mla" (one latent row) or "custom" (entries a model reads itself).
    kind: str
    block_size: int
    dtype: torch.dtype
    # Entry name -> per-token shape.
    entries: Mapping[str, tuple[int, ...]]

    @property
    def num_layers(self) -> int: ...

    @property
    def num_blocks(self) -> int:
        """Pages allocated per entry and layer (0 before :meth:`materialize`)."""
        ...

    @property
    def is_materialized(self) -> bool: ...

    def bytes_per_token(self) -> int:
        """Bytes one token costs in this pool, across all its layers and entries."""
        ...

    def bytes_per_block(self) -> int: ...

    def add_layers(self, count: int) -> range:
        """Reserve ``count`` more layers before materialisation; returns their indices."""
        ...

    def materialize(self, num_blocks: int, device: torch.device | str = "cpu") -> None:
        """Allocate ``num_blocks`` pages for every layer and entry."""
        ...

    def layer(self, index: int) -> Mapping[str, torch.Tensor]:
        """The entries of one layer, each ``[num_blocks, block_size, *entry_shape]``."""
        ...

    @property
    def quantized(self) -> bool:
        """Whether the pool stores fp8 values, each entry of each layer with its own scale."""
        ...

    def scale(self, layer: int, entry: str) -> float | None:
        """The scale of ``entry`` in ``layer`` (None for a pool that stores values as they are)."""
        ...

    def encode(self, layer: int, values: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """This step's ``values`` of ``layer`` as the pool stores them."""
        ...

    def decode(self, layer: int, entry: str, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Stored rows of ``entry`` (gathered from the pool's pages) as ``dtype`` values."""
        ...


class PagedPool:
    """A :class:`KVPool` with a free-form set of per-token entries; the two standard layouts subclass it.

    The pool is described first (layers can still be added, e.g. an MLA draft living in the target's
    pool as one extra layer) and gets its tensors from :meth:`materialize` once the cache has split
    the memory budget.
    """

    kind = "custom"

    def __init__(
        self,
        name: str,
        *,
        num_layers: int,
        block_size: int,
        dtype: torch.dtype,
        entries: Mapping[str, tuple[int, ...]],
    ):
        if block_size <= 0:
            raise ValueError(f"pool {name!r}: block_size must be positive, got {block_size}")
        if num_layers < 0:
            raise ValueError(f"pool {name!r}: num_layers must be >= 0, got {num_layers}")
        if not entries:
            raise ValueError(f"pool {name!r}: needs at least one entry")
        self.name = name
        self.block_size = block_size
        self.dtype = dtype
        self.entries = {key: tuple(shape) for key, shape in entries.items()}
        self._num_layers = num_layers
        self._tensors: dict[str, torch.Tensor] | None = None
        self._layers: list[MappingProxyType] = []
        self._scales: dict[tuple[int, str], float] = {}  # fp8 pools: per layer and entry, 1.0 unless set

    # ----- description -----
    @property
    def num_layers(self) -> int:
        return self._num_layers

    def add_layers(self, count: int) -> range:
        """Reserve ``count`` more layers before materialisation; returns their indices."""
        if self._tensors is not None:
            raise RuntimeError(f"pool {self.name!r} is already materialised; add layers before")
        first = self._num_layers
        self._num_layers += count
        return range(first, self._num_layers)

    def bytes_per_token(self) -> int:
        """Bytes one token costs in this pool, across all its layers and entries."""
        elems = sum(math.prod(shape) for shape in self.entries.values())
        return self._num_layers * elems * self.dtype.itemsize

    def bytes_per_block(self) -> int:
        return self.bytes_per_token() * self.block_size

    # ----- storage -----
    @property
    def is_materialized(self) -> bool:
        return self._tensors is not None

    @property
    def num_blocks(self) -> int:
        if self._tensors is None:
            return 0
        return next(iter(self._tensors.values())).shape[1]

    def materialize(self, num_blocks: int, device: torch.device | str = "cpu") -> None:
        # One tensor per entry for all layers keeps allocation to a handful of calls.
        self._tensors = {
            key: torch.zeros(
                (self._num_layers, num_blocks, self.block_size, *shape), dtype=self.dtype, device=device
            )
            for key, shape in self.entries.items()
        }
        # Every forward reads every layer: its views are made once, here.
        self._layers = [
            MappingProxyType({key: tensor[i] for key, tensor in self._tensors.items()}) for i in range(self._num_layers)
        ]

    def layer(self, index: int) -> Mapping[str, torch.Tensor]:
        """The entries of one layer, each ``[num_blocks, block_size, *entry_shape]`` (views of the storage)."""
        if self._tensors is None:
            raise RuntimeError(f"pool {self.name!r} has no storage yet: build the cache first")
        if not 0 <= index < self._num_layers:
            raise IndexError(f"pool {self.name!r} has {self._num_layers} layers, asked for layer {index}")
        return self._layers[index]

    # ----- fp8 storage (specdec.cache.quant) -----
    @property
    def quantized(self) -> bool:
        return is_fp8(self.dtype)

    def scale(self, layer: int, entry: str) -> float | None:
        return self._scales.get((layer, entry), 1.0) if self.quantized else None

    def set_scale(self, layer: int, entry: str, scale: float) -> None:
        if not self.quantized:
            raise ValueError(f"pool {self.name!r} stores {self.dtype}, which takes no scales")
        if not scale > 0:
            raise ValueError(f"pool {self.name!r}: a KV scale must be positive, got {scale}")
        self._scales[(layer, entry)] = float(scale)

    def encode(self, layer: int, values: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        if not self.quantized:
            return values
        return {key: quantize(value, self.scale(layer, key), self.dtype) for key, value in values.items()}

    def decode(self, layer: int, entry: str, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(stored, self.scale(layer, entry), dtype) if self.quantized else stored

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name!r}, layers={self._num_layers}, block_size={self.block_size}, "
            f"entries={self.entries}, dtype={self.dtype}, blocks={self.num_blocks})"
        )


class AttentionPool(PagedPool):
    """MHA/GQA layout: per layer, K and V pages of ``block_size x kv_heads x head_dim``."""

    kind = "attention"

    def __init__(
        self,
        name: str,
        *,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        v_head_dim: int | None = None,
        extra_entries: Mapping[str, tuple[int, ...]] | None = None,
    ):
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        entries = {"k": (num_kv_heads, head_dim), "v": (num_kv_heads, self.v_head_dim)}
        entries.update(extra_entries or {})
        super().__init__(name, num_layers=num_layers, block_size=block_size, dtype=dtype, entries=entries)


class MLAPool(PagedPool):
    """MLA layout: per layer one latent page of ``block_size x (kv_lora_rank + qk_rope_head_dim)``.

    The first ``kv_lora_rank`` columns are the normalised compressed KV, the rest the roped key part.
    """

    kind = "mla"

    def __init__(
        self,
        name: str,
        *,
        num_layers: int,
        block_size: int,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        dtype: torch.dtype,
    ):
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        super().__init__(
            name,
            num_layers=num_layers,
            block_size=block_size,
            dtype=dtype,
            entries={"latent": (kv_lora_rank + qk_rope_head_dim,)},
        )

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim
