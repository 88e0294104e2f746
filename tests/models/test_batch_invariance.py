"""Every op on the target's and drafts' paths, one row alone against the same row inside batches of 2..64
rows (other companions, other lengths), bit for bit: all invariant in the batch-invariant mode
(:mod:`specdec.backends.invariance`); without it, which ones vary is recorded (and must include the
linear layer, so the comparison cannot pass vacuously).

A "row" is a token's input for the per-token ops, and a request for attention: alone it decodes one
token; in a batch it is one of several requests of ragged lengths (shuffled pages) and runs as a
4-row verify whose first row is that same token.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs
import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig

from specdec.backends import invariance
from specdec.backends.base import AttentionMetadata
from specdec.backends.block_sparse import block_sparse_attention
from specdec.backends.torch_ref import TorchBackend
from specdec.models.deepseek_v3 import DeepseekV3Settings, DeepseekV3TopkRouter, absorbed_query, expanded_values
from specdec.models.layers import Linear, PackedLinear, RMSNorm, RotaryEmbedding, silu_and_mul
from specdec.models.minimax_m3 import MiniMaxM3Indexer, query_layout, swiglu_oai
from specdec.models.moe import FusedExperts, gated_activation, sigmoid_topk_routing
from specdec.sampling.processing import greedy_ids, target_probs
from specdec.sampling.random import STREAM_SAMPLE, categorical

HIDDEN, VOCAB, DTYPES = 256, 4096, (torch.bfloat16, torch.float32)
SIZES = (2, 5, 16, 64)
MAX_LEN = 310  # longest request (prompt + verify rows) of the attention and indexer cases


@attrs.frozen
class Op:
    """``run(rows)`` maps a batch of rows to one output per row (a tensor or a tuple of tensors)."""

    name: str
    run: Callable[[list[Any]], list[Any]]
    rows: Callable[[int], list[Any]]


def _bits(x) -> list[torch.Tensor]:
    parts = x if isinstance(x, tuple) else (x,)
    return [p.contiguous().view(torch.uint8) if p.is_floating_point() else p for p in parts]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(_bits(a), _bits(b), strict=True))


def first_difference(op: Op) -> tuple[int, int] | None:
    """The (batch size, position) where row 0's result first differs from its result alone, or None."""
    rows = op.rows(max(SIZES) + 1)
    alone = op.run(rows[:1])[0]
    for n in SIZES:
        for pos in (0, n - 1):
            batch = rows[1:n]
            batch.insert(pos, rows[0])
            if not _same(op.run(batch)[pos], alone):
                return n, pos
    return None


# ----------------------------------------------------------------------------- per-token ops
def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _vectors(width: int, dtype: torch.dtype, scale: float = 1.0):
    return lambda n: list((torch.randn(n, width, generator=_gen(n)) * scale).to(dtype))


def _rowwise(name: str, fn: Callable[[torch.Tensor], Any], rows) -> Op:
    def run(batch):
        out = fn(torch.stack(batch))
        return list(zip(*out)) if isinstance(out, tuple) else list(out)

    return Op(name, run, rows)


def _linear(k: int, n: int, dtype: torch.dtype, path: str) -> Linear:
    torch.manual_seed(k + n)
    layer = Linear(k, n, bias=path == "bias").to(dtype).requires_grad_(False)
    if path == "onednn":
        layer.prepack_weights()
    elif path == "float32 copy":  # what a CPU without half GEMMs serves a half layer from
        layer.prepacked = layer.weight.float().t().contiguous()
    return layer


def _deepseek_settings(groups: int) -> DeepseekV3Settings:
    config = DeepseekV3Config(hidden_size=HIDDEN, n_routed_experts=8, num_experts_per_tok=2, n_group=groups,
                              topk_group=max(1, groups // 2), moe_intermediate_size=64, kv_lora_rank=32,
                              q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                              num_attention_heads=4)
    return DeepseekV3Settings.from_hf_config(config)


def _experts(dtype: torch.dtype, prepack: bool, num_experts: int = 4) -> Op:
    """Few experts run every expert on every token; more (16 here) the routed schedule."""
    torch.manual_seed(0)
    experts = FusedExperts(num_experts, HIDDEN, 64, gated_activation("silu"), top_k=2)
    torch.nn.init.normal_(experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(experts.down_proj, std=0.05)
    experts = experts.to(dtype).requires_grad_(False)
    if prepack:  # the float32 copies a CPU without half GEMMs serves from
        experts.prepacked = tuple(w.float().transpose(1, 2).contiguous() for w in (experts.gate_up_proj, experts.down_proj))

    def run(batch):
        x = torch.stack([b[0] for b in batch])
        return list(experts(x, torch.stack([b[1] for b in batch]), torch.stack([b[2] for b in batch])))

    def rows(n):
        g = _gen(n)
        return [((torch.randn(HIDDEN, generator=g)).to(dtype), torch.randperm(num_experts, generator=g)[:2],
                 torch.rand(2, generator=g)) for _ in range(n)]

    return Op(f"MoE experts ({num_experts}" + (", float32 copies)" if prepack else ")"), run, rows)


def _mla_maps(dtype: torch.dtype) -> Op:
    torch.manual_seed(1)
    w_uk, w_uv = torch.randn(4, 16, 32).to(dtype), torch.randn(4, 16, 32).to(dtype)
    work = torch.float32  # the absorbed maps' float32 copies, or the half maps themselves

    def fn(x):
        return (absorbed_query(x[:, :, :16].to(work), w_uk.to(work)),
                expanded_values(x.to(work), w_uv.to(work)))

    return _rowwise("MLA absorbed einsums", fn, lambda n: list(torch.randn(n, 4, 32, generator=_gen(n)).to(dtype)))


def _rope(dtype: torch.dtype, interleaved: bool) -> Op:
    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=4, max_position_embeddings=512)
    rotary = RotaryEmbedding(config, 64, interleaved=interleaved)

    def run(batch):
        positions = torch.tensor([b[1] for b in batch])
        return list(rotary(positions, torch.stack([b[0] for b in batch]))[0])

    rows = lambda n: [(t, int(p)) for t, p in zip(torch.randn(n, 4, 64, generator=_gen(n)).to(dtype),  # noqa: E731
                                                 torch.randint(0, 500, (n,), generator=_gen(n + 1)))]
    return Op("RoPE" + (" (interleaved)" if interleaved else ""), run, rows)


def _sampler(dtype: torch.dtype) -> Op:
    def run(batch):
        logits = torch.stack([b[0] for b in batch])
        temperature = torch.tensor([b[1] for b in batch], dtype=torch.float64)
        top_k = torch.tensor([b[2] for b in batch])
        top_p = torch.tensor([b[3] for b in batch], dtype=torch.float64)
        probs = target_probs(logits, temperature, top_k, top_p)
        seeds, counters = torch.tensor([b[4] for b in batch]), torch.tensor([b[5] for b in batch])
        return list(zip(probs, categorical(probs, seeds, counters, STREAM_SAMPLE), greedy_ids(logits)))

    def rows(n):
        g = _gen(n)
        return [((torch.randn(VOCAB, generator=g) * 3).to(dtype), [0.0, 0.7, 1.0][i % 3], [0, 50][i % 2],
                 [1.0, 0.9][i % 2], 1000 + i, 7 * i) for i in range(n)]

    return Op("sampler (temperature, top-k, top-p, seeded draw, greedy argmax)", run, rows)


def _indexer(dtype: torch.dtype) -> Op:
    """MiniMax-M3's block scores: each query token against its own request's cached indexer keys."""
    config = LlamaConfig(hidden_size=HIDDEN, index_n_heads=2, index_head_dim=64, index_block_size=16,
                         index_topk_blocks=4, index_local_blocks=1, rms_norm_eps=1e-6, num_attention_heads=4)
    indexer = MiniMaxM3Indexer(config)

    def run(batch):
        verify = 1 if len(batch) == 1 else 4
        seq_lens = [length + verify - 1 for length, _ in batch]
        keys = torch.zeros(len(batch), max(seq_lens), 64, dtype=dtype)
        queries = []
        for i, (length, seed) in enumerate(batch):
            g = _gen(seed)  # the same draws whatever the request's length: a prefix is the same tokens
            keys[i, : seq_lens[i]] = torch.randn(MAX_LEN, 64, generator=g)[: seq_lens[i]].to(dtype)
            queries.append(torch.randn(4, 2, 64, generator=g)[:verify].to(dtype))
        meta = AttentionMetadata.build(query_lens=[verify] * len(batch), seq_lens=seq_lens,
                                       block_tables=torch.zeros(len(batch), 1, dtype=torch.int32),
                                       slot_mapping=torch.zeros(0, dtype=torch.int64), block_size=1)
        request, offset, query_pos = query_layout(meta)
        scores = indexer.block_scores(torch.cat(queries), keys, meta, request, offset, query_pos)
        chosen = indexer.select_blocks(scores, query_pos, meta.max_seq_len)
        # Each request's first query row, over the keys it can see.
        return [(scores[i * verify, :, : -(-length // 16)], chosen[i * verify, :, :length])
                for i, (length, _) in enumerate(batch)]

    rows = lambda n: [(int(s), 100 + i) for i, s in enumerate(torch.randint(1, 200, (n,), generator=_gen(n)))]  # noqa: E731
    return Op("MiniMax-M3 indexer scores and block choice", run, rows)


def _eagle3_head(dtype: torch.dtype) -> Op:
    from specdec.proposers.eagle3.config import Eagle3DraftConfig
    from specdec.proposers.eagle3.model import Eagle3LlamaDraft

    config = attrs.evolve(Eagle3DraftConfig.from_folder("specdec/zoo/minimax-m3-tiny-eagle3"), fc_norm=True)
    torch.manual_seed(2)
    head = Eagle3LlamaDraft(config, aux_layer_ids=(1, 3, 5), target_hidden_size=HIDDEN, own_embedding=True,
                            own_lm_head=True)
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.05)
    head = head.to(dtype).requires_grad_(False)
    return _rowwise("EAGLE3 head fc_norm + fc", head.combine_aux, _vectors(3 * HIDDEN, dtype))


def token_ops(dtype: torch.dtype) -> list[Op]:
    """The per-token ops, built for ``dtype``."""
    ops = [_rowwise(f"linear ({path})", _linear(HIDDEN, 512, dtype, path), _vectors(HIDDEN, dtype))
           for path in ("F.linear", "bias", "onednn") + (("float32 copy",) if dtype != torch.float32 else ())]
    torch.manual_seed(3)
    qkv = PackedLinear(HIDDEN, {"q_proj": 256, "k_proj": 128, "v_proj": 128}).to(dtype).requires_grad_(False)
    ops.append(_rowwise("packed q/k/v", lambda x: qkv.split(qkv(x)), _vectors(HIDDEN, dtype)))
    head = _linear(HIDDEN, VOCAB, dtype, "onednn")
    ops.append(_rowwise("LM head + greedy argmax", lambda x: (head(x), greedy_ids(head(x))), _vectors(HIDDEN, dtype)))
    halves = [_linear(HIDDEN, VOCAB // 2, dtype, "onednn") for _ in range(2)]
    ops.append(_rowwise("LM head, vocabulary split over 2 ranks",
                        lambda x: torch.cat([h(x) for h in halves], dim=-1), _vectors(HIDDEN, dtype)))
    for unit_offset in (False, True):
        norm = RMSNorm(HIDDEN, unit_offset=unit_offset).to(dtype)
        torch.nn.init.normal_(norm.weight, std=0.5)
        ops.append(_rowwise(f"RMSNorm (unit_offset={unit_offset})", norm, _vectors(HIDDEN, dtype, 3.0)))
    ops += [_rope(dtype, False), _rope(dtype, True)]
    ops.append(_rowwise("SiLU-and-mul", lambda x: silu_and_mul(*x.chunk(2, dim=-1)), _vectors(512, dtype, 4.0)))
    ops.append(_rowwise("SwiGLU-OAI", lambda x: swiglu_oai(x, 1.702, 7.0), _vectors(512, dtype, 4.0)))
    for groups in (1, 4):
        router = DeepseekV3TopkRouter(_deepseek_settings(groups))
        torch.nn.init.normal_(router.weight, std=0.1)
        torch.nn.init.normal_(router.e_score_correction_bias, std=0.01)
        router.requires_grad_(False)
        ops.append(_rowwise(f"DeepSeek-V3 router ({groups} groups)", router, _vectors(HIDDEN, dtype)))
    gate = _linear(HIDDEN, 4, dtype, "onednn")
    bias = torch.randn(4, generator=_gen(4)) * 0.01
    ops.append(_rowwise("MiniMax router", lambda x: sigmoid_topk_routing(gate(x), bias, 2), _vectors(HIDDEN, dtype)))
    ops += [_experts(dtype, False), _experts(dtype, False, 16), _mla_maps(dtype), _indexer(dtype),
            _eagle3_head(dtype), _sampler(dtype)]
    if dtype != torch.float32:
        ops += [_experts(dtype, True), _experts(dtype, True, 16)]
    return ops


# ----------------------------------------------------------------------------- attention
def _attention(dtype: torch.dtype, kind: str, block_size: int, backend=None) -> Op:
    """Paged attention of one request's first query row (``kind``: gqa, gqa+lse, block-sparse, mla)."""
    backend = backend or TorchBackend()
    heads, kv_heads, dim = (4, 1, 48) if kind == "mla" else (4, 2, 32)

    def run(batch):
        verify = 1 if len(batch) == 1 else 4
        seq_lens = [length + verify - 1 for length, _ in batch]
        blocks = [-(-s // block_size) for s in seq_lens]
        order = torch.randperm(sum(blocks) + 2, generator=_gen(len(batch))).tolist()
        table = torch.zeros(len(batch), max(blocks), dtype=torch.int32)
        cache = torch.randn(len(order), block_size, kv_heads, 2 * dim, generator=_gen(99)).to(dtype)  # stale data
        queries, masks = [], []
        for i, (length, seed) in enumerate(batch):
            table[i, : blocks[i]] = torch.tensor([order.pop() for _ in range(blocks[i])], dtype=torch.int32)
            g = _gen(seed)  # the same draws whatever the request's length: a prefix is the same tokens
            kv = torch.randn(MAX_LEN, kv_heads, 2 * dim, generator=g).to(dtype)
            for p in range(seq_lens[i]):
                cache[table[i, p // block_size], p % block_size] = kv[p]
            queries.append(torch.randn(4, heads, dim, generator=g)[:verify].to(dtype))
            masks.append((torch.rand(4, 2, MAX_LEN, generator=g) < 0.7)[:verify, :, : seq_lens[i]])
        meta = AttentionMetadata.build(query_lens=[verify] * len(batch), seq_lens=seq_lens, block_tables=table,
                                       slot_mapping=torch.zeros(0, dtype=torch.int64), block_size=block_size)
        q = torch.cat(queries)
        if kind == "mla":
            out = backend.mla_attention(q, cache[..., 0, :dim].contiguous(), meta, kv_lora_rank=32, scale=0.2)
        elif kind == "block-sparse":
            keep = torch.zeros(len(q), 2, meta.max_seq_len, dtype=torch.bool)
            for i, mask in enumerate(masks):
                keep[i * verify : (i + 1) * verify, :, : seq_lens[i]] = mask
            k_cache, v_cache = cache[..., :dim].contiguous(), cache[..., dim:].contiguous()
            out = block_sparse_attention(backend, q, k_cache, v_cache, meta, keep, scale=0.2)
        else:
            k_cache, v_cache = cache[..., :dim].contiguous(), cache[..., dim:].contiguous()
            out = backend.attention(q, k_cache, v_cache, meta, scale=0.2, return_lse=kind == "gqa+lse")
        if isinstance(out, tuple):
            return [(out[0][i * verify], out[1][i * verify]) for i in range(len(batch))]
        return [out[i * verify] for i in range(len(batch))]

    rows = lambda n: [(int(s), 10 + i) for i, s in enumerate(torch.randint(1, 300, (n,), generator=_gen(n)))]  # noqa: E731
    return Op(f"{backend.name} attention, {kind}, page {block_size}", run, rows)


def attention_ops(dtype: torch.dtype) -> list[Op]:
    return [_attention(dtype, kind, page) for kind, page in
            (("gqa", 16), ("gqa", 128), ("gqa+lse", 1), ("block-sparse", 16), ("mla", 16), ("mla", 1))]


# ----------------------------------------------------------------------------- the tests
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_op_is_batch_invariant_in_the_mode(dtype):
    with invariance.batch_invariant():
        varying = {op.name: d for op in token_ops(dtype) + attention_ops(dtype) if (d := first_difference(op))}
    assert varying == {}


def test_the_mode_holds_at_two_threads():
    """The GEMM blocking and the elementwise routines also hold when torch splits work over threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with invariance.batch_invariant():
            ops = token_ops(torch.float32)[:4] + [_experts(torch.bfloat16, False), _attention(torch.float32, "gqa", 16)]
            varying = {op.name: d for op in ops if (d := first_difference(op))}
    finally:
        torch.set_num_threads(threads)
    assert varying == {}


def test_without_the_mode_ops_vary():
    """What breaks invariance today (printed with ``-s``); the linear layer must be among them."""
    varying = {}
    for dtype in DTYPES:
        for op in token_ops(dtype) + attention_ops(dtype):
            if (where := first_difference(op)) is not None:
                varying[f"{op.name} [{str(dtype).removeprefix('torch.')}]"] = where
    print("\nvaries without batch_invariant (batch size, position):")
    for name, where in varying.items():
        print(f"  {name}: {where}")
    assert "linear (F.linear) [float32]" in varying


def test_triton_kernel_is_batch_invariant_in_the_mode():
    """The project's kernel (under the interpreter here) with one tile shape and one key split."""
    pytest.importorskip("triton")
    from specdec.backends.triton import TritonBackend

    op = _attention(torch.float32, "gqa", 16, TritonBackend())
    op = attrs.evolve(op, rows=lambda n: [(int(s), 10 + i) for i, s in enumerate(torch.randint(1, 90, (n,), generator=_gen(n)))])
    with invariance.batch_invariant():
        rows = op.rows(6)
        alone = op.run(rows[:1])[0]
        for n, pos in ((2, 1), (5, 0)):
            batch = rows[1:n]
            batch.insert(pos, rows[0])
            assert _same(op.run(batch)[pos], alone), (n, pos)
    assert math.isfinite(float(alone.float().abs().sum()))
