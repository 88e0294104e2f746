"""Attention whose every query row sums its keys in an order fixed by the row alone (batch-invariant).

The torch backend's fast path pads a batch to its longest request and hands it to one fused kernel:
how a row's scores and values are summed then depends on that length and on the kernel's tiling of
the batch. Here the GEMMs have one shape whatever the batch:

- A request's query rows (token x head of a KV group) form tiles of :data:`TILE_ROWS` rows per KV head,
  the last tile padded; the batch's tiles run :data:`TILES_PER_CALL` at a time (:func:`fixed_bmm`).
- Keys come in fixed splits of :data:`~specdec.backends.invariance.KEY_SPLIT` positions from position 0,
  those a row may not see masked to ``-inf``, merged by an online softmax in split order. A split that
  holds none of a row's keys (past its causal end, a shorter request's padding) leaves the row's
  running state exactly as it was (weight ``exp(-inf) = 0``, rescale ``exp(0) = 1``).

So a row's result is the same alone, beside any other requests, and as one of a verify's rows. It
runs in float32 (float64 for float64 queries), the output rounded once.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from specdec.backends.base import AttentionMetadata, AttentionOutput, lse_dtype
from specdec.backends.invariance import KEY_SPLIT, in_row_blocks

# Query rows per GEMM tile: a k=3 verify of a 4-head group fills one.
TILE_ROWS = 16
# Tiles per batched GEMM call (the last call padded with zero tiles).
TILES_PER_CALL = 8


def fixed_bmm(a: torch.Tensor, b: torch.Tensor, *, transpose_b: bool = False) -> torch.Tensor:
    """``torch.bmm(a, b)`` (``b`` transposed per entry with ``transpose_b``) in calls of exactly
    :data:`TILES_PER_CALL` batch entries (zero-padded), so every call has one shape and an entry's
    product does not depend on how many there are."""
    product = (lambda x, y: torch.bmm(x, y.transpose(1, 2))) if transpose_b else torch.bmm
    return in_row_blocks(product, a, b, block=TILES_PER_CALL)


@attrs.frozen
class RowTiles:
    """A batch's query rows, ``(token, head)`` pairs, grouped per (request, KV head) into tiles of
    :data:`TILE_ROWS` rows (the rows of a group share its keys); padding rows are not ``valid``."""

    request: torch.Tensor  # [N] the request of each tile
    kv_head: torch.Tensor  # [N]
    token: torch.Tensor  # [N, TILE_ROWS]
    head: torch.Tensor  # [N, TILE_ROWS]
    valid: torch.Tensor  # [N, TILE_ROWS]

    @classmethod
    def build(cls, meta: AttentionMetadata, num_heads: int, num_kv_heads: int) -> "RowTiles":
        device = meta.seq_lens.device
        group = num_heads // num_kv_heads
        rows = meta.query_lens.long() * group
        tiles = -(-rows // TILE_ROWS)
        per_request = tiles * num_kv_heads
        request = torch.repeat_interleave(torch.arange(len(rows), device=device), per_request)
        local = torch.arange(len(request), device=device) - (torch.cumsum(per_request, 0) - per_request)[request]
        per_head = tiles[request]
        kv_head, tile = local // per_head, local % per_head
        flat = tile[:, None] * TILE_ROWS + torch.arange(TILE_ROWS, device=device)
        valid = flat < rows[request][:, None]
        token = meta.query_start_loc[:-1].long()[request][:, None] + flat // group
        head = kv_head[:, None] * group + flat % group
        return cls(request, kv_head, token.where(valid, 0), head.where(valid, 0), valid)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` laid out as tiles ``[N, TILE_ROWS, D]`` (zeros in padding rows)."""
        return x[self.token, self.head].where(self.valid[..., None], 0)

    def scatter(self, tiles: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Tiles ``[N, TILE_ROWS, ...]`` written back into ``out [T, H, ...]``."""
        out[self.token[self.valid], self.head[self.valid]] = tiles[self.valid]
        return out


def fixed_split_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    return_lse: bool = False,
) -> AttentionOutput:
    """``q [T, H, D]`` against each request's gathered ``keys [B, S, Hkv, D]`` and ``values [B, S, Hkv,
    Dv]`` (``meta``'s layout, causality, window and ``custom_mask``), as the backends' ``attention``:
    ``[T, H, Dv]`` in ``q``'s dtype, with ``lse [T, H]`` on request. A query that sees no key gets 0
    (and ``-inf``)."""
    num_tokens, num_heads, _ = q.shape
    num_kv_heads, v_dim = keys.shape[2], values.shape[-1]
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    # What depends on the layout alone is built once per forward, for every layer.
    tiles = meta.derived(("fixed_split.tiles", num_heads, num_kv_heads),
                         lambda m: RowTiles.build(m, num_heads, num_kv_heads))
    visible, spans = meta.derived(("fixed_split.visible", num_heads, num_kv_heads, sliding_window),
                                  lambda m: _layout_visibility(m, tiles, sliding_window))
    if meta.custom_mask is not None:
        visible = visible & _padded_columns(meta.custom_mask[:, : meta.max_seq_len], visible.shape[-1])[tiles.token]
    key_rows = meta.derived(("fixed_split.key_rows", num_heads, num_kv_heads, sliding_window),
                            lambda m: _key_rows(m, tiles, num_kv_heads, spans))
    keys, values = _per_head_rows(keys, work), _per_head_rows(values, work)
    query = tiles.gather(q.to(work))
    m = query.new_full(tiles.valid.shape, float("-inf"))
    total = query.new_zeros(tiles.valid.shape)
    acc = query.new_zeros(*tiles.valid.shape, v_dim)
    for span, (rows, held) in zip(spans, key_rows):  # the splits some row sees: the others are no-ops for every row
        k = keys.index_select(0, rows).view(*held.shape[:2], -1)  # [N, KEY_SPLIT, D]
        # Keys past a request's length are masked by score, their values zeroed too (0 * NaN is NaN).
        v = values.index_select(0, rows).view(*held.shape[:2], -1).where(held, 0)
        scores = (fixed_bmm(query, k, transpose_b=True) * scale).masked_fill(~visible[..., span], float("-inf"))
        m_new = torch.maximum(m, scores.amax(dim=-1))
        # A row that has seen no key yet keeps max -inf: shift by 0 so its weights are 0, not NaN.
        shift = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp(scores - shift[..., None])
        rescale = torch.exp(m - shift)
        total = total * rescale + p.sum(dim=-1)
        acc = acc * rescale[..., None] + fixed_bmm(p, v)
        m = m_new
    seen_any = total > 0
    out_tiles = torch.where(seen_any[..., None], acc / torch.where(seen_any, total, 1.0)[..., None], 0.0)
    out = tiles.scatter(out_tiles, q.new_zeros(num_tokens, num_heads, v_dim, dtype=work)).to(q.dtype)
    if not return_lse:
        return out
    lse_tiles = torch.where(seen_any, m + torch.log(torch.where(seen_any, total, 1.0)), float("-inf"))
    lse = tiles.scatter(lse_tiles, q.new_full((num_tokens, num_heads), float("-inf"), dtype=work))
    return out, lse.to(lse_dtype(q.dtype))


def fixed_split_scores(q: torch.Tensor, keys: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The plain dot products ``q [T, H, D]`` . its request's ``keys [B, S, D]``, ``[T, H, S]`` in ``q``'s
    dtype, by the same fixed-shape GEMMs (MiniMax-M3's indexer scores in the batch-invariant mode)."""
    num_tokens, num_heads, _ = q.shape
    seq = keys.shape[1]
    tiles = RowTiles.build(meta, num_heads, 1)
    keys = _split_padded(keys[:, :, None], q.dtype)[:, :, 0]
    query = tiles.gather(q)
    out = torch.cat([fixed_bmm(query, keys[tiles.request, span], transpose_b=True) for span in _spans(keys.shape[1])],
                    dim=-1)
    return tiles.scatter(out, q.new_zeros(num_tokens, num_heads, keys.shape[1]))[..., :seq]


def _split_padded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [B, S, ...]`` as ``dtype``, zero-padded along ``S`` to whole splits (at least one)."""
    return _padded_columns(x.to(dtype), _split_width(x.shape[1]), dim=1)


def _split_width(seq: int) -> int:
    return max(1, -(-seq // KEY_SPLIT)) * KEY_SPLIT


def _padded_columns(x: torch.Tensor, width: int, dim: int = 1) -> torch.Tensor:
    """``x`` zero-padded (False for bool) along ``dim`` to ``width``."""
    return F.pad(x, (0, 0) * (x.dim() - dim - 1) + (0, width - x.shape[dim]))


def _per_head_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered ``x [B, S, Hkv, D]`` as ``dtype`` rows ``[B * Hkv * S, D]``, row ``(b * Hkv + h) * S + s``."""
    return x.transpose(1, 2).reshape(-1, x.shape[-1]).to(dtype)


def _key_rows(meta: AttentionMetadata, tiles: RowTiles, num_kv_heads: int, spans: list[slice]):
    """Per split of ``spans``: the row of :func:`_per_head_rows` each tile reads at each of its positions
    (flat ``[N * KEY_SPLIT]``; a position past the gathered keys reads the last), and bool ``[N,
    KEY_SPLIT, 1]``: the positions its request holds."""
    seq = meta.max_seq_len
    base = (tiles.request * num_kv_heads + tiles.kv_head)[:, None] * seq
    lengths = meta.seq_lens.long()[tiles.request][:, None]
    out = []
    for span in spans:
        pos = torch.arange(span.start, span.stop, device=base.device)
        out.append(((base + pos.clamp(max=seq - 1)).flatten(), (pos < lengths)[..., None]))
    return out


def _spans(width: int) -> list[slice]:
    return [slice(start, start + KEY_SPLIT) for start in range(0, width, KEY_SPLIT)]


def _layout_visibility(meta: AttentionMetadata, tiles: RowTiles, sliding_window: int | None):
    """bool ``[N, TILE_ROWS, width]``, the keys each tile row may see by position (its request's length,
    causality, the window), and the key splits any row sees."""
    query_lens = meta.query_lens.long()
    request = torch.repeat_interleave(torch.arange(len(query_lens), device=query_lens.device), query_lens)
    offset = torch.arange(len(request), device=request.device) - meta.query_start_loc[:-1].long()[request]
    position = (meta.seq_lens.long()[request] - query_lens[request] + offset)[tiles.token][..., None]
    key_pos = torch.arange(_split_width(meta.max_seq_len), device=request.device)
    seen = tiles.valid[..., None] & (key_pos < meta.seq_lens.long()[tiles.request][:, None, None])
    if meta.causal:
        seen &= key_pos <= position
    if sliding_window is not None:
        seen &= key_pos > position - sliding_window
    spans = [span for span in _spans(seen.shape[-1]) if bool(seen[..., span].any())]
    return seen, spans
