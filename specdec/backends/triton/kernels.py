"""The project's Triton kernels: page writes, paged varlen attention, split-KV reduction.

Every kernel runs compiled on a GPU and, under ``TRITON_INTERPRET=1``, on the CPU. Launchers live in
:mod:`.ops`; this module holds only ``@triton.jit`` code so its import decides the mode once.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

# Fixed at decoration time: see runtime.kernels_interpreted.
INTERPRETED: bool = bool(knobs.runtime.interpret)


@triton.jit
def write_slots_kernel(
    src0_ptr,
    dst0_ptr,
    src1_ptr,
    dst1_ptr,
    slots_ptr,
    stride_src0,
    stride_dst0,
    stride_src1,
    stride_dst1,
    WIDTH0: tl.constexpr,
    WIDTH1: tl.constexpr,
    HAS_SECOND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row ``t`` of each source goes to row ``slots[t]`` of its flat ``[num_slots, width]`` cache.

    Two entries (K and V) share one launch; a negative slot marks a padding token and is skipped.
    """
    token = tl.program_id(0)
    chunk = tl.program_id(1)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask0 = offs < WIDTH0
        row0 = tl.load(src0_ptr + token.to(tl.int64) * stride_src0 + offs, mask=mask0)
        tl.store(dst0_ptr + slot * stride_dst0 + offs, row0.to(dst0_ptr.dtype.element_ty), mask=mask0)
        if HAS_SECOND:
            mask1 = offs < WIDTH1
            row1 = tl.load(src1_ptr + token.to(tl.int64) * stride_src1 + offs, mask=mask1)
            tl.store(dst1_ptr + slot * stride_dst1 + offs, row1.to(dst1_ptr.dtype.element_ty), mask=mask1)


@triton.jit
def paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    lse_ptr,
    part_acc_ptr,
    part_ml_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    mask_ptr,
    scale_ptr,
    kv_scale_ptr,
    sliding_window,
    row_blocks,
    num_heads,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_mask,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    SHARED_KV: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_MASK: tl.constexpr,
    HAS_LSE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    """Online-softmax attention of one request's query rows against its pages, one KV head.

    Rows of a program are (query token, head of the GQA group) pairs, ``row = q_idx * GROUP + g``, so a
    decode step of a large group (MLA: every head shares the one latent "head") fills the tile instead
    of wasting it. ``SHARED_KV`` is MLA: values are the first ``V_DIM`` key columns, loaded once and
    used for both products. With ``NUM_SPLITS > 1`` each program covers a slice of the keys and
    writes unnormalised partials for :func:`split_reduce_kernel` (flash-decoding), which keeps the
    GPU busy when there are few requests and heads. ``HAS_LSE`` also writes each row's log-sum-exp
    of the scaled scores to ``lse [T, num_heads]`` (contiguous), for merging attention over several
    pools; with splits the reduction writes it. ``UPCAST`` runs the products in fp32 (keys and
    values follow the query's dtype): Triton's interpreter multiplies bf16 tiles wrongly. ``KV_SCALED``:
    fp8 pages, read as the stored value times its scale (``kv_scale [2]``: keys', values'; MLA's latent
    takes the first).
    """
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = pid // row_blocks
    row_block = pid % row_blocks

    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    num_rows = q_len * GROUP
    first_row = row_block * BLOCK_M
    if first_row < num_rows:
        seq_len = tl.load(seq_lens_ptr + req)
        context = seq_len - q_len
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = rows < num_rows
        q_idx = rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        q_pos = context + q_idx
        token = (q_start + q_idx).to(tl.int64)

        # The key range any row of this tile can see; causality and the window prune whole tiles.
        hi = seq_len
        if CAUSAL:
            last_row = tl.minimum(first_row + BLOCK_M, num_rows) - 1
            hi = tl.minimum(seq_len, context + last_row // GROUP + 1)
        lo = 0
        if HAS_WINDOW:
            # Down to a key tile's edge: tiles start at multiples of BLOCK_N for every row (batch-invariant).
            lo = tl.maximum(0, context + first_row // GROUP - sliding_window + 1) // BLOCK_N * BLOCK_N
        per_split = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        split_lo = lo + split * per_split
        split_hi = tl.minimum(hi, split_lo + per_split)

        offs_dv = tl.arange(0, DV_PAD)
        dv_ok = offs_dv < V_DIM
        q_rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
        scale = tl.load(scale_ptr)
        if KV_SCALED:
            k_scale = tl.load(kv_scale_ptr)
            v_scale = tl.load(kv_scale_ptr + 1)
        if SHARED_KV:
            offs_r = tl.arange(0, R_PAD)
            r_ok = offs_r < HEAD_DIM - V_DIM
            q_a = tl.load(q_rows + offs_dv[None, :], mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
            q_b = tl.load(q_rows + V_DIM + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
            if UPCAST:
                q_a = q_a.to(tl.float32)
                q_b = q_b.to(tl.float32)
        else:
            offs_d = tl.arange(0, D_PAD)
            d_ok = offs_d < HEAD_DIM
            q = tl.load(q_rows + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=ACC)
        l_i = tl.zeros([BLOCK_M], dtype=ACC)
        acc = tl.zeros([BLOCK_M, DV_PAD], dtype=ACC)
        table = block_tables_ptr + req.to(tl.int64) * stride_bt

        for start in range(split_lo, split_hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < split_hi
            page = tl.load(table + n // PAGE, mask=n_ok, other=0).to(tl.int64)
            k_rows = k_ptr + page * stride_kb + (n % PAGE).to(tl.int64) * stride_ks + kv_head * stride_kh
            if SHARED_KV:
                kv = tl.load(k_rows[:, None] + offs_dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
                k_b = tl.load(
                    k_rows[:, None] + V_DIM + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0.0
                )
                if KV_SCALED:
                    kv = kv.to(ACC) * k_scale
                    k_b = k_b.to(ACC) * k_scale
                kv = kv.to(q_a.dtype)
                s = tl.dot(q_a, tl.trans(kv), input_precision="ieee", out_dtype=ACC)
                s += tl.dot(q_b, tl.trans(k_b.to(q_b.dtype)), input_precision="ieee", out_dtype=ACC)
                v = kv
            else:
                k = tl.load(k_rows[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
                if KV_SCALED:
                    k = k.to(ACC) * k_scale
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision="ieee", out_dtype=ACC)
                v_rows = v_ptr + page * stride_vb + (n % PAGE).to(tl.int64) * stride_vs + kv_head * stride_vh
                v = tl.load(v_rows[:, None] + offs_dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
                if KV_SCALED:
                    v = v.to(ACC) * v_scale
                v = v.to(q.dtype)
            s = s * scale

            visible = row_ok[:, None] & n_ok[None, :]
            if CAUSAL:
                visible = visible & (n[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (n[None, :] > q_pos[:, None] - sliding_window)
            if HAS_MASK:
                allowed = tl.load(
                    mask_ptr + token[:, None] * stride_mask + n[None, :], mask=visible, other=0
                )
                visible = visible & (allowed != 0)
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row that has seen no key yet keeps max -inf; shift by 0 so exp gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_shift[:, None])
            alpha = tl.exp(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee", out_dtype=ACC)
            m_i = m_new

        if NUM_SPLITS == 1:
            # Rows that see no key at all (a custom mask can do that) return zeros like the reference.
            out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
            out_rows = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
            tl.store(out_rows + offs_dv[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
            if HAS_LSE:
                lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
                tl.store(lse_ptr + token * num_heads + head, lse.to(lse_ptr.dtype.element_ty), mask=row_ok)
        else:
            # Partials are [T, H, NUM_SPLITS, DV_PAD] and [T, H, NUM_SPLITS, 2] (max, sum), contiguous.
            part = (token * num_heads + head) * NUM_SPLITS + split
            tl.store(part_acc_ptr + part[:, None] * DV_PAD + offs_dv[None, :], acc, mask=row_ok[:, None])
            tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
            tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def split_reduce_kernel(
    out_ptr,
    lse_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_heads,
    stride_ot,
    stride_oh,
    V_DIM: tl.constexpr,
    DV_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """Merge the split-KV partials of one (token, head) with log-sum-exp weights."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_dv = tl.arange(0, DV_PAD)
    base = (token * num_heads + head) * NUM_SPLITS
    m = tl.load(part_ml_ptr + (base + offs_s) * 2)
    l = tl.load(part_ml_ptr + (base + offs_s) * 2 + 1)
    m_max = tl.max(m, axis=0)
    m_shift = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_shift)
    total = tl.sum(w * l, axis=0)
    parts = tl.load(part_acc_ptr + (base + offs_s)[:, None] * DV_PAD + offs_dv[None, :])
    acc = tl.sum(parts * w[:, None], axis=0)
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_dv, out.to(out_ptr.dtype.element_ty), mask=offs_dv < V_DIM)
    if HAS_LSE:
        lse = tl.where(total > 0, m_shift + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + token * num_heads + head, lse.to(lse_ptr.dtype.element_ty))
