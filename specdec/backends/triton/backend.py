"""The ``triton`` attention backend: the project's own kernels behind the AttentionBackend protocol."""

from __future__ import annotations

from typing import Mapping

import torch

from specdec.backends import pages
from specdec.backends.base import AttentionMetadata, AttentionOutput
from specdec.backends.triton.config import KernelConfig
from specdec.backends.triton.runtime import check_runnable


class TritonBackend:
    """Paged varlen attention (GQA, sliding window, tree masks) and absorbed MLA in Triton.

    Any page size works: pages are addressed per token, so a page need not be a power of two or match
    the kernel's key tile. Runs compiled on a GPU, or on the CPU when ``TRITON_INTERPRET=1`` was set
    before the kernels were first imported; otherwise construction fails with one line saying so.
    """

    name = "triton"
    supports_custom_mask = True
    supports_batch_invariant = True  # see specdec.backends.invariance

    def __init__(self, config: KernelConfig | None = None):
        check_runnable()
        if config is not None and not isinstance(config, KernelConfig):
            raise TypeError(f"TritonBackend(config=...) takes a KernelConfig, got {type(config).__name__}")
        self.config = config or KernelConfig()
        # Imported here, not at module level, so selecting another backend never loads Triton.
        from specdec.backends.triton import ops

        self._ops = ops

    def supports_block_size(self, block_size: int, pool_kind: str) -> bool:
        if pool_kind not in ("attention", "mla"):
            return False
        return isinstance(block_size, int) and block_size >= 1

    def supports_kv_dtype(self, dtype: torch.dtype, pool_kind: str) -> bool:
        return True  # fp8 pages are converted and scaled as the kernel loads them

    def write_kv(
        self, layer: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor], slot_mapping: torch.Tensor
    ) -> None:
        self._ops.write_slots(layer, values, slot_mapping)

    # A model's own reads of an entry are one gather, which torch does as well as a kernel would.
    gather_pages = staticmethod(pages.gather_pages)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
                  scale: float, sliding_window: int | None = None, return_lse: bool = False,
                  k_scale: float | None = None, v_scale: float | None = None) -> AttentionOutput:
        return self._ops.paged_attention(
            q,
            k_cache,
            v_cache,
            meta,
            scale=scale,
            sliding_window=sliding_window,
            config=self.config,
            return_lse=return_lse,
            kv_scales=None if k_scale is None else (k_scale, v_scale),
        )

    def mla_attention(self, q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, *,
                      kv_lora_rank: int, scale: float, return_lse: bool = False,
                      latent_scale: float | None = None) -> AttentionOutput:
        if latent_cache.dim() != 3:
            raise ValueError(
                f"mla_attention: latent cache must be [blocks, page, kv_lora_rank + rope_dim], got {tuple(latent_cache.shape)}"
            )
        # The latent is one KV "head" shared by every query head; values are its first columns.
        return self._ops.paged_attention(
            q,
            latent_cache.unsqueeze(2),
            None,
            meta,
            scale=scale,
            v_dim=kv_lora_rank,
            config=self.config,
            return_lse=return_lse,
            kv_scales=None if latent_scale is None else (latent_scale, latent_scale),
        )
