"""The ``aiter`` attention backend: AMD aiter's kernels over the project's page layout.

- Paged (GQA) attention: aiter's ``unified_attention`` Triton kernel, which reads the pool layout
  ``[blocks, page, kv_heads, head_dim]`` as is and handles the varlen causal verify shape (compiled
  for the GPU on ROCm, under Triton's interpreter on a CPU).
- MLA: each query token becomes one decode row over its causal prefix, addressed per token (a page-1
  view of the latent pool, so any pool page size works), and runs through aiter's ``mla_decode_fwd``
  assembly kernel on ROCm when its constraints hold (bf16, 16 or 128 heads, 512 + 64 latent), else
  through aiter's Triton ``decode_attention_fwd_grouped_rope``. Long query runs (prefill) use
  ``unified_attention`` with the latent as keys and as values, keeping the first ``kv_lora_rank``
  output columns.
- Log-sum-exp outputs (``return_lse``, for merging attention over two pools): only MLA, through the
  Triton decode kernel, whose per-split partials carry each split's LSE; non-causal MLA (a pool of
  keys that all precede the queries) runs there too. ``unified_attention`` keeps its LSE internal
  and is causal-only, so GQA attention with ``return_lse`` raises ``NotImplementedError``.

aiter's native MHA decode ops (``paged_attention_rocm``, ``pa_fwd_asm``) need a different page
layout (``[blocks, kv_heads, head_dim / x, page, x]``) than the pools allocate, so they are not used.
"""

from __future__ import annotations

import contextlib

import torch

from specdec.backends import aiter_loader, pages
from specdec.backends.base import AttentionMetadata, AttentionOutput
from specdec.cache.quant import is_fp8

# Up to this many queries per request, MLA runs as per-token decode rows (verify: k + 1 queries).
MLA_DECODE_MAX_QUERIES = 16

# unified_attention's non-decode key tile; its block-table reads run to the end of a tile, unmasked.
_UNIFIED_TILE = 64


class AiterBackend:
    """Selecting it without amd-aiter installed fails with one line naming ``pip install specdec[rocm]``."""

    name = "aiter"
    # aiter's unified_attention takes causal and sliding-window masks only.
    supports_custom_mask = False

    def __init__(self, mla_decode_max_queries: int = MLA_DECODE_MAX_QUERIES):
        if not isinstance(mla_decode_max_queries, int) or mla_decode_max_queries < 1:
            raise ValueError(f"mla_decode_max_queries must be a positive int, got {mla_decode_max_queries!r}")
        self.kernels = aiter_loader.load()
        self.mla_decode_max_queries = mla_decode_max_queries

    @property
    def mode(self) -> str:
        """``rocm-native``, ``triton-gpu`` or ``triton-interpreter``."""
        return self.kernels.mode

    def supports_block_size(self, block_size: int, pool_kind: str) -> bool:
        if not isinstance(block_size, int) or block_size < 1:
            return False
        if pool_kind == "attention":
            # aiter's paged attention wants multiples of 16; unified_attention's decode path also tiles
            # keys by the page (tl.arange), which needs a power of two.
            return _unified_page_ok(block_size)
        if pool_kind == "mla":
            return True  # addressed per token
        return False

    def supports_kv_dtype(self, dtype: torch.dtype, pool_kind: str) -> bool:
        # unified_attention dequantizes fp8 K/V by per-tensor scales; the MLA decode kernels take none.
        return not is_fp8(dtype) or pool_kind == "attention"

    # The pools keep the plain token-major layout, so a scatter writes them and a gather reads them.
    write_kv = staticmethod(pages.scatter_slots)
    gather_pages = staticmethod(pages.gather_pages)

    # ------------------------------------------------------------------ paged attention

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
                  scale: float, sliding_window: int | None = None, return_lse: bool = False,
                  k_scale: float | None = None, v_scale: float | None = None) -> torch.Tensor:
        if return_lse:
            raise NotImplementedError(
                "aiter's unified_attention returns no log-sum-exp, so attention over two KV pools (KV sharing) "
                "cannot be merged; use attention_backend='triton' or 'torch' for that layer"
            )
        _check_supported(meta, q)
        if v_cache.shape[-1] != q.shape[-1] or k_cache.shape[-1] != q.shape[-1]:
            raise ValueError(
                f"aiter's unified_attention needs equal query, key and value head sizes, got q {q.shape[-1]}, "
                f"k {k_cache.shape[-1]}, v {v_cache.shape[-1]}; use attention_backend='triton'"
            )
        if not _unified_page_ok(meta.block_size):
            raise ValueError(
                f"aiter attention needs a page size that is a power of two and a multiple of 16, got "
                f"{meta.block_size}; set block_size=16 (or 32, 64, ...)"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"attention: sliding_window must be >= 1 (or None), got {sliding_window}")
        return self._unified(q, k_cache, v_cache, meta, scale=scale, sliding_window=sliding_window,
                             kv_scales=None if k_scale is None else (k_scale, v_scale))

    def _unified(self, q, k_cache, v_cache, meta, *, scale, sliding_window=None, kv_scales=None):
        out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        device = q.device
        # fp8 pages: the kernel multiplies each loaded K/V tile by these float32 scalars.
        descales = [None, None] if kv_scales is None else \
            [torch.tensor([s], dtype=torch.float32, device=device) for s in kv_scales]
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        with self._quiet():
            self.kernels.unified_attention(
                q.contiguous(),
                k_cache,
                v_cache,
                out,
                cu_seqlens_q=meta.query_start_loc.to(device=device, dtype=torch.int32),
                max_seqlen_q=meta.max_query_len,
                seqused_k=meta.seq_lens.to(device=device, dtype=torch.int32),
                max_seqlen_k=meta.max_seq_len,
                softmax_scale=scale,
                causal=True,
                window_size=window,
                block_table=_padded_block_table(meta, device),
                softcap=0.0,
                q_descale=None,
                k_descale=descales[0],
                v_descale=descales[1],
            )
        return out

    # ------------------------------------------------------------------ MLA

    def mla_attention(self, q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, *,
                      kv_lora_rank: int, scale: float, return_lse: bool = False,
                      latent_scale: float | None = None) -> AttentionOutput:
        if latent_scale is not None:
            raise ValueError("aiter's MLA kernels read no fp8 latent pages; use attention_backend='triton' or 'torch'")
        _check_supported(meta, q, mla=True)
        num_tokens, num_heads, width = q.shape
        if latent_cache.dim() != 3 or latent_cache.shape[-1] != width:
            raise ValueError(
                f"mla_attention: latent cache must be [blocks, page, {width}] to match q, got {tuple(latent_cache.shape)}"
            )
        if not 0 < kv_lora_rank < width:
            raise ValueError(f"mla_attention: kv_lora_rank must be in (0, {width}), got {kv_lora_rank}")
        if num_tokens == 0:
            out = q.new_empty(0, num_heads, kv_lora_rank)
            return (out, q.new_empty(0, num_heads, dtype=torch.float32)) if return_lse else out
        # Only the Triton decode rows give an LSE and run non-causal; everything else keeps its path.
        plain = meta.causal and not return_lse
        if plain and meta.max_query_len > self.mla_decode_max_queries and _unified_page_ok(meta.block_size):
            latent = latent_cache.unsqueeze(2)
            return self._unified(q, latent, latent, meta, scale=scale)[..., :kv_lora_rank].contiguous()
        rows = _per_token_rows(meta, q.device)
        if plain and self._native_mla_fits(q, latent_cache, kv_lora_rank):
            return self._native_mla(q, latent_cache, rows, kv_lora_rank=kv_lora_rank, scale=scale)
        out, lse = self._triton_mla(
            q, latent_cache, rows, kv_lora_rank=kv_lora_rank, scale=scale, max_seq_len=meta.max_seq_len
        )
        return (out, lse) if return_lse else out

    def _triton_mla(self, q, latent_cache, rows, *, kv_lora_rank, scale, max_seq_len):
        """Decode rows through aiter's Triton MLA kernel; returns ``(out, lse)``."""
        kv_indptr, kv_indices = rows
        num_tokens, num_heads, width = q.shape
        tokens = latent_cache.reshape(-1, 1, width)  # page-1 view: one "page" per cached token
        values = tokens[..., :kv_lora_rank]
        out = q.new_empty(num_tokens, num_heads, kv_lora_rank)
        splits = _mla_splits(max_seq_len, interpreted=self.mode == "triton-interpreter")
        logits = torch.empty(num_tokens, num_heads, splits, kv_lora_rank + 1, dtype=torch.float32, device=q.device)
        with self._quiet():
            self.kernels.mla_decode(
                q.contiguous(),
                tokens,
                values,
                out,
                kv_indptr,
                kv_indices,
                None,  # k_pe_tokens: only with fused rope
                kv_lora_rank,
                width - kv_lora_rank,
                None,  # cos_sin_cache
                None,  # positions
                logits,
                splits,
                scale,
                logit_cap=0.0,
                use_rope=False,  # the model ropes q and the cached keys itself
                is_neox_style=False,
                config=self.kernels.mla_config(),
            )
        lengths = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
        # Stage 1 leaves a split that got no keys unwritten (its slot is garbage) and stores each
        # written split's own LSE after the values; the kernel splits a row's keys as below.
        per_split = (lengths + splits - 1) // splits
        written = torch.arange(splits, device=q.device)[None, :] * per_split[:, None] < lengths[:, None]
        split_lse = logits[..., kv_lora_rank].masked_fill(~written[:, None, :], float("-inf"))
        lse = torch.logsumexp(split_lse, dim=-1)
        # A row with no key divides 0 by 0 in stage 2; the protocol wants zeros there.
        out.masked_fill_((lengths == 0)[:, None, None], 0.0)
        return out, lse

    def _quiet(self):
        # Padding rows of aiter's tiles divide by zero before being masked out; under the interpreter
        # numpy would warn about each of them.
        if self.mode == "triton-interpreter":
            import numpy

            return numpy.errstate(divide="ignore", invalid="ignore")
        return contextlib.nullcontext()

    def _native_mla_fits(self, q, latent_cache, kv_lora_rank) -> bool:
        return (
            self.kernels.native_mla_decode is not None
            and q.is_cuda
            and q.dtype == torch.bfloat16
            and latent_cache.dtype == torch.bfloat16
            and q.shape[1] in (16, 128)
            and (kv_lora_rank, q.shape[2]) == (512, 576)
        )

    def _native_mla(self, q, latent_cache, rows, *, kv_lora_rank, scale):  # pragma: no cover - ROCm only
        kv_indptr, kv_indices = rows
        num_tokens, num_heads, width = q.shape
        out = q.new_empty(num_tokens, num_heads, kv_lora_rank)
        ones = torch.ones(num_tokens, dtype=torch.int32, device=q.device)
        self.kernels.native_mla_decode(
            q.contiguous(),
            latent_cache.reshape(-1, 1, 1, width),  # [pages, page_size=1, kv_heads=1, 576]
            out,
            torch.arange(num_tokens + 1, dtype=torch.int32, device=q.device),  # one query per row
            kv_indptr.to(torch.int32),
            kv_indices.to(torch.int32),
            ones,  # kv_last_page_lens: every page-1 page is full
            1,
            sm_scale=scale,
        )
        return out


def _check_supported(meta: AttentionMetadata, q: torch.Tensor, *, mla: bool = False) -> None:
    if (not meta.causal and not mla) or meta.custom_mask is not None:
        raise NotImplementedError(
            "aiter's attention kernels are causal-only and take no custom (tree) mask; use "
            "attention_backend='triton' or 'torch' for that"
        )
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(
            f"aiter's kernels accumulate in float32 and take float32/float16/bfloat16, got {q.dtype}; "
            "use attention_backend='triton' or 'torch' for float64"
        )


def _unified_page_ok(block_size: int) -> bool:
    return block_size >= 16 and block_size % 16 == 0 and block_size & (block_size - 1) == 0


def _padded_block_table(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """The block table widened so unified_attention's whole-tile (unmasked) table reads stay inside."""
    table = meta.block_tables.to(device=device, dtype=torch.int32)
    tile = max(_UNIFIED_TILE, meta.block_size)
    needed = -(-meta.max_seq_len // tile) * tile // meta.block_size + 1
    if table.shape[1] < needed:
        table = torch.nn.functional.pad(table, (0, needed - table.shape[1]))
    return table.contiguous()


def _per_token_rows(meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token as a decode row: ``kv_indptr [T + 1]`` and the token slots it sees, in order.

    Query ``j`` of request ``i`` sees positions ``0 .. seq_len - query_len + j`` (causal), so running
    the rows independently is the verify/prefill attention exactly; without ``meta.causal`` every
    query sees all ``seq_len`` keys. A request with no keys gives empty rows.
    """
    seq_lens = meta.seq_lens.to(device=device, dtype=torch.int64)
    query_lens = meta.query_lens.to(device=device, dtype=torch.int64)
    request = torch.repeat_interleave(torch.arange(meta.num_requests, device=device), query_lens)
    starts = meta.query_start_loc.to(device=device, dtype=torch.int64)[:-1]
    offset = torch.arange(request.numel(), device=device) - starts[request]
    if meta.causal:
        visible = (seq_lens[request] - query_lens[request] + offset + 1).clamp(min=0)
    else:
        visible = seq_lens[request]
    kv_indptr = torch.zeros(request.numel() + 1, dtype=torch.int64, device=device)
    kv_indptr[1:] = visible.cumsum(0)
    total = int(kv_indptr[-1])
    row = torch.repeat_interleave(torch.arange(request.numel(), device=device), visible, output_size=total)
    position = torch.arange(total, device=device) - kv_indptr[row]
    table = meta.block_tables.to(device=device, dtype=torch.int64)
    bs = meta.block_size
    kv_indices = table[request[row], position // bs] * bs + position % bs
    return kv_indptr.to(torch.int32), kv_indices


def _mla_splits(max_seq_len: int, *, interpreted: bool) -> int:
    # Each split streams at least a couple of the kernel's 32-key tiles.
    if interpreted:
        return max(1, min(4, max_seq_len // 64))
    return max(1, min(16, max_seq_len // 256))
