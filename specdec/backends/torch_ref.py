"""The torch reference backend: plain tensor ops, exact in any dtype, the yardstick for kernels."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from specdec.backends.base import AttentionMetadata, AttentionOutput, lse_dtype, math_dtype
from specdec.backends import invariance, pages, ragged
from specdec.backends.fixed_split import fixed_split_attention
from specdec.cache.quant import dequantize


class TorchBackend:
    """Gathers each request's pages into a padded batch and runs masked softmax attention.

    Vectorised over the batch (no per-request Python), so it is also a usable CPU backend.
    """

    name = "torch"
    supports_custom_mask = True
    supports_batch_invariant = True  # see specdec.backends.invariance

    def supports_block_size(self, block_size: int, pool_kind: str) -> bool:
        return block_size >= 1

    def supports_kv_dtype(self, dtype: torch.dtype, pool_kind: str) -> bool:
        return True  # fp8 pages are read back by a conversion after the gather

    # The pools' token-major pages: a scatter writes them, a gather reads them.
    write_kv = staticmethod(pages.scatter_slots)
    gather_pages = staticmethod(pages.gather_pages)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, *,
                  scale: float, sliding_window: int | None = None, return_lse: bool = False,
                  k_scale: float | None = None, v_scale: float | None = None) -> AttentionOutput:
        work = math_dtype(q.dtype, q.device)

        def attend(q: torch.Tensor, meta: AttentionMetadata) -> AttentionOutput:
            keys = _read(k_cache, meta, k_scale, work)  # [B, S, Hkv, D]
            values = _read(v_cache, meta, v_scale, work)
            return _masked_attention(
                q, keys, values, meta, scale=scale, sliding_window=sliding_window, return_lse=return_lse
            )

        return _in_groups(attend, q, meta, return_lse)

    def mla_attention(self, q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, *,
                      kv_lora_rank: int, scale: float, return_lse: bool = False,
                      latent_scale: float | None = None) -> AttentionOutput:
        def attend(q: torch.Tensor, meta: AttentionMetadata) -> AttentionOutput:
            # [B, S, 1, L + R], in the dtype attention runs in: keys and values are views of one conversion.
            latent = _read(latent_cache, meta, latent_scale, math_dtype(q.dtype, q.device)).unsqueeze(2)
            return _masked_attention(q, latent, latent[..., :kv_lora_rank], meta, scale=scale, return_lse=return_lse)

        return _in_groups(attend, q, meta, return_lse)


def _in_groups(attend, q: torch.Tensor, meta: AttentionMetadata, return_lse: bool) -> AttentionOutput:
    """``attend`` over groups of close query lengths (the padded batch would be mostly padding when a
    prompt shares a step with decoding requests), or whole in the batch-invariant mode, whose
    fixed-split path pads nothing and keeps its per-row order whatever the batch."""
    if invariance.enabled():
        return attend(q, meta)
    return ragged.attend_in_groups(attend, q, meta, return_lse=return_lse)


def _read(cache: torch.Tensor, meta: AttentionMetadata, scale: float | None, dtype: torch.dtype) -> torch.Tensor:
    """Each request's cached rows of one entry as ``dtype`` values (an fp8 pool's dequantized by ``scale``)."""
    rows = pages.gather_pages(cache, meta)
    return dequantize(rows, scale, dtype) if scale is not None else rows.to(dtype)


def _layout_mask(meta: AttentionMetadata, sliding_window: int | None) -> torch.Tensor:
    """The keys each query may see by position alone (sequence length, causality, sliding window), laid
    out per request: bool ``[B, max_query_len, max_seq_len]``, padding rows seeing nothing."""
    device = meta.seq_lens.device
    seq_lens = meta.seq_lens.long()[:, None, None]  # [B, 1, 1]
    query_lens = meta.query_lens.long()[:, None, None]
    slot = torch.arange(meta.max_query_len, device=device)[None, :, None]  # [1, Q, 1]
    query_pos = seq_lens - query_lens + slot  # absolute position of each query
    key_pos = torch.arange(meta.max_seq_len, device=device)
    mask = (key_pos < seq_lens) & (slot < query_lens)
    if meta.causal:
        mask = mask & (key_pos <= query_pos)
    if sliding_window is not None:
        mask = mask & (key_pos > query_pos - sliding_window)
    return mask


def _sees_every_key(meta: AttentionMetadata, sliding_window: int | None) -> bool:
    """Whether every query of a batch with ``max_query_len`` queries per request may see every key
    (decode with equal lengths, or a non-causal pool of equal lengths): then no mask is needed."""
    return (
        0 < meta.min_seq_len == meta.max_seq_len
        and (meta.max_query_len == 1 or not meta.causal)
        and (sliding_window is None or sliding_window >= meta.max_seq_len)
    )


def _masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, meta: AttentionMetadata, *,
                      scale: float, sliding_window: int | None = None, return_lse: bool = False) -> AttentionOutput:
    """``q [T, H, D]`` against per-request ``keys [B, S, Hkv, D]``, ``values [B, S, Hkv, Dv]``.

    Queries are padded per request to ``[B, max_query_len, H, D]`` (a view when every request has
    ``max_query_len`` of them: decode and verify batches), so scores are ``[B, H, max_query_len, S]``,
    not ``[T, S, ...]``. A query that sees no key gets 0 (and ``-inf`` LSE). Half types the CPU has no
    kernels for run in float32 (:func:`~specdec.backends.base.math_dtype`), the output rounded back.
    """
    if invariance.enabled():  # each row's keys in fixed splits, whatever the batch (backends.fixed_split)
        return fixed_split_attention(q, keys, values, meta, scale=scale, sliding_window=sliding_window,
                                     return_lse=return_lse)
    num_tokens, num_heads, head_dim = q.shape
    batch = keys.shape[0]
    out_dtype, work = q.dtype, math_dtype(q.dtype, q.device)
    q, keys, values = q.to(work), keys.to(work), values.to(work)
    uniform = num_tokens == batch * meta.max_query_len
    request, offset = (None, None) if uniform else _query_index(meta)
    if uniform:
        padded_q = q.view(batch, meta.max_query_len, num_heads, head_dim)
    else:
        padded_q = q.new_zeros(batch, meta.max_query_len, num_heads, head_dim)
        padded_q[request, offset] = q
    custom = None
    if meta.custom_mask is not None:  # [T, >= S], ANDed with the layout
        custom = meta.custom_mask[:, : meta.max_seq_len]
        if uniform:
            custom = custom.view(batch, meta.max_query_len, -1)
        else:
            custom = custom.new_zeros(batch, meta.max_query_len, custom.shape[-1]).index_put_((request, offset), custom)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)  # [B, Hkv, S, D]
    if return_lse or keys.shape[-1] != values.shape[-1]:
        # Written out: for the LSE, and for values narrower than keys (MLA), which torch's fused kernel
        # does not take (its fallback repeats K/V for every head and runs several times slower).
        mask = _layout_mask_of(meta, sliding_window)
        out, lse = _explicit_attention(padded_q.transpose(1, 2), keys, values, mask if custom is None else mask & custom,
                                       scale, with_lse=return_lse)
        if return_lse:
            lse = lse.transpose(1, 2)  # [B, max_query_len, H]
            lse = lse.reshape(num_tokens, num_heads) if uniform else lse[request, offset]
    else:
        sees_all = uniform and _sees_every_key(meta, sliding_window)
        # A KV head's query heads fold into its query rows where that is faster (:func:`_folded_gqa`);
        # each row then needs its query's bias, repeated per head of the group.
        group = num_heads // keys.shape[1]
        folds = group > 1 and (1 < meta.max_query_len <= FOLD_MAX_QUERY_LEN or (
            meta.max_query_len == 1 and single_queries_fold(work, num_heads, keys.shape[1], head_dim, q.device)))
        rows_per_query = group if folds else 1
        if custom is not None:
            bias = _score_bias(custom if sees_all else _layout_mask_of(meta, sliding_window) & custom, work,
                               rows_per_query)
        else:  # the layout's mask alone: one bias per forward, for every layer
            bias = None if sees_all else meta.derived(
                ("torch_ref.bias", sliding_window, work, rows_per_query),
                lambda m: _score_bias(_layout_mask_of(m, sliding_window), work, rows_per_query),
            )
        # torch's fused kernel (float32 accumulation for half types; GQA without repeating K/V). Rows
        # that see no key come back as 0, which tests/backends/test_torch_ref.py holds it to.
        queries = padded_q.transpose(1, 2)  # [B, H, Q, D]
        if rows_per_query > 1:
            out = _folded_gqa(queries, keys, values, bias, scale)
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=bias, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2)  # [B, max_query_len, H, Dv]
    out = (out.reshape(num_tokens, num_heads, -1) if uniform else out[request, offset]).to(out_dtype)
    return (out, lse) if return_lse else out


# Longest per-request query run whose GQA groups fold into the query rows (:func:`_folded_gqa`): verify
# steps and short chunks. Past it the repeated bias grows with the prompt and folding gains nothing.
FOLD_MAX_QUERY_LEN = 16


def _folded_gqa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                scale: float) -> torch.Tensor:
    """``q [B, H, Q, D]`` with each KV head's query heads as ``group * Q`` rows of one attention over
    ``keys/values [B, Hkv, S, *]`` (``bias [B, 1, group * Q, S]``, :func:`_score_bias`). The same
    arithmetic per row as ``enable_gqa``, but torch's CPU kernel runs several queries per request
    1.2-3.8x faster this way (bf16, 1 to 32 requests of 150 to 600 keys, 2 to 6 queries, 2 to 4 heads a
    group). For one query it depends on the CPU (:func:`single_queries_fold`)."""
    batch, num_heads, max_query, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    rows = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads * max_query, head_dim)  # h = kv * group + g
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=bias, scale=scale)
    return out.view(batch, num_heads, max_query, -1)


# Per (dtype, heads, KV heads, head size): whether decode's one query per request folds (measured once).
_SINGLE_QUERIES_FOLD: dict[tuple, bool] = {}


def single_queries_fold(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                        device: torch.device) -> bool:
    """Whether decode (one query per request) runs faster through :func:`_folded_gqa` than through
    ``enable_gqa``, timed once per process and shape on a batch of 8 requests of 256 keys.

    It depends on the CPU's kernels, both ways and by far: on an AMD EPYC with AVX-512 bf16 but no AMX,
    bf16 decode attention ran 4-7x faster folded (1 to 32 requests of 150 to 400 keys, 4 or 6 heads
    over 2); on an Intel Xeon with AMX it ran up to 1.7x slower. Off the CPU decode keeps ``enable_gqa``."""
    if device.type != "cpu":
        return False
    key = (dtype, num_heads, num_kv_heads, head_dim)
    if key not in _SINGLE_QUERIES_FOLD:
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(8, num_heads, 1, head_dim, generator=generator).to(dtype)
        keys, values = (torch.randn(8, num_kv_heads, 256, head_dim, generator=generator).to(dtype) for _ in range(2))
        folded = lambda: _folded_gqa(q, keys, values, None, 1.0)  # noqa: E731
        grouped = lambda: F.scaled_dot_product_attention(q, keys, values, scale=1.0, enable_gqa=True)  # noqa: E731
        _SINGLE_QUERIES_FOLD[key] = _runs_faster(folded, grouped)
    return _SINGLE_QUERIES_FOLD[key]


def _runs_faster(first, second, repeats: int = 7) -> bool:
    """Whether ``first()`` takes less time than ``second()`` (medians, runs alternating)."""
    seconds = ([], [])
    for _ in range(repeats + 1):
        for run, timed in zip((first, second), seconds):
            started = time.perf_counter()
            run()
            timed.append(time.perf_counter() - started)
    first_median, second_median = (sorted(timed[1:])[repeats // 2] for timed in seconds)  # the first run warms
    return first_median < second_median


def _layout_mask_of(meta: AttentionMetadata, sliding_window: int | None) -> torch.Tensor:
    """:func:`_layout_mask`, once per forward."""
    return meta.derived(("torch_ref.mask", sliding_window), lambda m: _layout_mask(m, sliding_window))


def _score_bias(mask: torch.Tensor, dtype: torch.dtype, rows_per_query: int = 1) -> torch.Tensor:
    """A bool ``mask [B, Q, S]`` as the ``[B, 1, Q, S]`` scores' bias: 0 where a key is seen, ``-inf``
    elsewhere. SDPA turns a bool mask into exactly this on every call; a forward's layers share one.
    With ``rows_per_query`` g > 1: ``[B, 1, g * Q, S]``, row ``j * Q + i`` query i's (folded GQA)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias[:, None] if rows_per_query == 1 else bias[:, None].repeat(1, 1, rows_per_query, 1)


def _explicit_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, *, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax attention written out: ``q [B, H, Q, D]``, ``keys/values [B, Hkv, S, *]``, ``mask [B, Q, S]``;
    returns ``out [B, H, Q, Dv]`` and, ``with_lse``, ``lse [B, H, Q]`` (else None). GQA groups the
    query heads of a KV head as rows of one product, so K/V are never repeated."""
    batch, num_heads, max_query, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    qg = q.reshape(batch, num_kv_heads, group * max_query, head_dim)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).view(batch, num_kv_heads, group, max_query, -1) * scale
    scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    # Rows that see no key at all: zero them instead of producing NaN.
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = torch.matmul(probs.view(batch, num_kv_heads, group * max_query, -1), values)
    lse = None
    if with_lse:  # a row that sees no key gets -inf (logsumexp of nothing), the merge's "contributes nothing"
        lse = torch.logsumexp(scores.to(lse_dtype(q.dtype)), dim=-1).view(batch, num_heads, max_query)
    return out.view(batch, num_heads, max_query, -1), lse


def _query_index(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query token: its request index and its offset within that request's queries."""
    return meta.derived("query_index", _compute_query_index)


def _compute_query_index(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    device = meta.seq_lens.device
    request = torch.repeat_interleave(torch.arange(meta.num_requests, device=device), meta.query_lens.long())
    offset = torch.arange(meta.num_query_tokens, device=device) - meta.query_start_loc[:-1].long()[request]
    return request, offset
