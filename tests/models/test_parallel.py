"""How weights are cut for tensor parallelism, in one process without a group.

``specdec.models.parallel``: ``ShardSpec`` / ``PartsShard`` slices, ``HeadShard`` (split, or KV heads
replicated below the rank count), the sharded layers' shapes. The loader: each zoo model loaded with
rank 0's and rank 1's shapes of two (``parallel_state.building``; shapes and weights only, no forward,
which would need the group) holds exactly its slices: the two ranks' slices put back together are the
one-rank model's tensors, themselves the checkpoint's (checked against the safetensors directly too).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdec.distributed import parallel_state as ps
from specdec.models.layers import PackedLinear
from specdec.models.loader import iter_safetensors, load_model
from specdec.models.parallel import (
    ColumnParallelLinear,
    HeadShard,
    PartsShard,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    VocabParallelHead,
    padded_vocab,
)
from specdec.zoo import zoo_path


# ----------------------------------------------------------------------------- slices
def test_shard_spec_takes_its_chunk_along_its_dim():
    t = torch.arange(24.0).reshape(4, 6)
    assert torch.equal(ShardSpec(0, 1, 2).take(t), t[2:])
    assert torch.equal(ShardSpec(1, 2, 3).take(t), t[:, 4:])
    assert torch.equal(ShardSpec(-1, 0, 2).take(t), t[:, :3])
    assert ShardSpec(0, 0, 1).is_whole and not ShardSpec(0, 0, 2).is_whole


def test_shard_spec_pads_a_vocabulary_the_ranks_do_not_divide():
    t = torch.arange(1.0, 15.0).reshape(7, 2)  # 7 rows over 2 ranks: padded to 8, the last row zero
    first, second = ShardSpec(0, 0, 2, padded=8).take(t), ShardSpec(0, 1, 2, padded=8).take(t)
    assert torch.equal(first, t[:4])
    assert torch.equal(second, torch.cat([t[4:], torch.zeros(1, 2)]))
    assert torch.equal(ShardSpec(1, 1, 2, padded=8).take(t.T), second.T)  # along another dim


def test_parts_shard_cuts_each_packed_part_by_its_own_spec():
    qkv = torch.arange(8.0)  # q = 0..3, k = 4..5, v = 6..7

    def parts(rank):
        return PartsShard(0, ((4, ShardSpec(0, rank, 2)), (2, ShardSpec(0, rank, 2)), (2, ShardSpec(0, rank, 2))))
    assert parts(0).take(qkv).tolist() == [0, 1, 4, 6]
    assert parts(1).take(qkv).tolist() == [2, 3, 5, 7]
    # A replicated part (one KV head on every rank) is whole on each.
    replicated = PartsShard(0, ((4, ShardSpec(0, 1, 2)), (2, ShardSpec(0, 0, 1)), (2, ShardSpec(0, 0, 1))))
    assert replicated.take(qkv).tolist() == [2, 3, 4, 5, 6, 7]
    assert not replicated.is_whole and PartsShard(0, ((4, ShardSpec(0, 0, 1)),)).is_whole


def test_head_shard_splits_heads_or_replicates_kv_heads_below_the_rank_count():
    for rank in range(2):
        with ps.building(rank, 2):
            assert HeadShard.of(4, "heads") == HeadShard(2, ShardSpec(0, rank, 2))
            assert HeadShard.of(1, "kv heads") == HeadShard(1, ShardSpec(0, 0, 1))  # both ranks hold it
    # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1 (the head their queries read).
    for rank, head in enumerate([0, 0, 1, 1]):
        with ps.building(rank, 4):
            assert HeadShard.of(2, "kv heads") == HeadShard(1, ShardSpec(0, head, 2))
    # Query heads never replicate: 2 over 4 ranks is an error, like 2 KV heads over 3.
    with ps.building(0, 4), pytest.raises(ValueError, match=r"num_attention_heads \(2\)"):
        HeadShard.split(2, "num_attention_heads")
    with ps.building(0, 3), pytest.raises(ValueError) as err:
        HeadShard.of(2, "num_key_value_heads")
    assert str(err.value).splitlines() == [
        "num_key_value_heads (2) is not divisible by tensor_parallel_size 3; choose a tensor_parallel_size that divides it"
    ]


# ----------------------------------------------------------------------------- layers
def test_parallel_layers_hold_their_rank_share():
    with ps.building(1, 2), torch.device("meta"):
        column = ColumnParallelLinear(8, 6, bias=True)
        row = RowParallelLinear(6, 8, bias=True)
        embedding = VocabParallelEmbedding(7, 4)
        head = VocabParallelHead(4, 7)
        assert padded_vocab(7) == 8
        with pytest.raises(ValueError, match=r"^o_proj in \(5\) is not divisible by tensor_parallel_size 2;"):
            RowParallelLinear(5, 8, what="o_proj in")
    assert column.weight.shape == (3, 8) and column.bias.shape == (3,)
    assert column.tp_shards == {"weight": ShardSpec(0, 1, 2), "bias": ShardSpec(0, 1, 2)}
    assert row.weight.shape == (8, 3) and row.bias.shape == (8,)  # the bias is whole, added once
    assert row.tp_shards == {"weight": ShardSpec(1, 1, 2)}
    assert embedding.weight.shape == (4, 4) and embedding.vocab_start == 4
    assert embedding.tp_shards == {"weight": ShardSpec(0, 1, 2, padded=8)}
    assert head.weight.shape == (4, 4) and head.tp_shards == {"weight": ShardSpec(0, 1, 2, padded=8)}
    assert padded_vocab(7) == 7  # one rank


def test_one_rank_layers_are_the_plain_layers():
    torch.manual_seed(0)
    row, embedding = RowParallelLinear(6, 4, bias=True), VocabParallelEmbedding(7, 3)
    for p in (*row.parameters(), embedding.weight):
        torch.nn.init.normal_(p)
    x, ids = torch.randn(5, 6), torch.tensor([0, 6, 3])
    assert torch.allclose(row(x), F.linear(x, row.weight, row.bias))
    assert torch.equal(embedding(ids), F.embedding(ids, embedding.weight))


# ----------------------------------------------------------------------------- the loader
def _parts(model, name: str, tensor: torch.Tensor) -> list[int]:
    """Widths of the packed parts of ``name`` along its sharded dim (one part when not packed)."""
    module_name, _, param = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, PackedLinear):
        return list(module.parts.values())
    if param == "gate_up_proj":  # fused experts: gate | up along dim 1
        return [tensor.shape[1] // 2] * 2
    return []


def _reassemble(name, full_model, full, ranks, rank_models) -> str:
    """Check that ``ranks`` (each rank's tensor of ``name``) are slices of ``full``; say how."""
    if all(t.shape == full.shape for t in ranks):
        for t in ranks:
            assert torch.equal(t, full), f"{name}: replicated, but a rank's copy differs"
        return "replicated"
    (dim,) = [d for d in range(full.dim()) if ranks[0].shape[d] != full.shape[d]]
    full_widths = _parts(full_model, name, full) or [full.shape[dim]]
    rank_widths = [_parts(m, name, t) or [t.shape[dim]] for m, t in zip(rank_models, ranks)]
    how = "split"
    for j, piece in enumerate(full.split(full_widths, dim=dim)):
        pieces = [t.split(w, dim=dim)[j] for t, w in zip(ranks, rank_widths)]
        if all(p.shape == piece.shape for p in pieces):  # a part whole on every rank (one KV head)
            assert all(torch.equal(p, piece) for p in pieces), f"{name}: part {j} differs"
            how = "split, some parts replicated"
            continue
        joined = torch.cat(pieces, dim=dim)
        assert joined.shape[dim] >= piece.shape[dim]
        assert torch.equal(joined.narrow(dim, 0, piece.shape[dim]), piece), f"{name}: part {j} is not the rank slices"
        padding = joined.narrow(dim, piece.shape[dim], joined.shape[dim] - piece.shape[dim])
        assert not padding.any(), f"{name}: vocabulary padding is not zero"
    return how


def _expect(layout: dict[str, str], pattern: str, how: str) -> None:
    matched = [n for n in layout if pattern in n]
    assert matched, f"no parameter matches {pattern!r}"
    assert {layout[n] for n in matched} == {how}, {n: layout[n] for n in matched}


# What must be split, and what whole on every rank, per zoo model (besides the norms).
EXPECTED = {
    "llama-tiny": {
        "split": ["embed_tokens", "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"],
        "replicated": ["layernorm", "model.norm"],
    },
    "kimi-k2-tiny": {
        "split": ["embed_tokens", "lm_head", "q_b_proj", "kv_b_proj", "self_attn.o_proj", "experts.gate_up_proj",
                  "experts.down_proj", "shared_experts.gate_up_proj", "shared_experts.down_proj",
                  "layers.0.mlp.gate_up_proj"],
        "replicated": ["q_a_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "mlp.gate.weight", "e_score_correction_bias"],
    },
    "minimax-m3-tiny": {
        "split": ["embed_tokens", "lm_head", "self_attn.qkv_proj", "self_attn.o_proj", "indexer.q_proj",
                  "experts.gate_up_proj", "experts.down_proj", "shared_experts.gate_up_proj"],
        "replicated": ["indexer.k_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate.weight"],
    },
    # 2 query heads and 1 KV head: q splits, k and v are whole on both ranks.
    "draft-model-tiny": {
        "split, some parts replicated": ["self_attn.qkv_proj"],
        "split": ["embed_tokens", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"],
        "replicated": ["layernorm"],
    },
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_rank_loads_exactly_its_slices_of_the_checkpoint(name):
    path = zoo_path(name)
    full_model = load_model(path, dtype="float64")
    rank_models = []
    for rank in range(2):
        with ps.building(rank, 2):
            rank_models.append(load_model(path, dtype="float64"))
    full = dict(full_model.named_parameters())
    ranks = [dict(m.named_parameters()) for m in rank_models]
    assert all(set(r) == set(full) for r in ranks)
    layout = {n: _reassemble(n, full_model, t, [r[n] for r in ranks], rank_models) for n, t in full.items()}
    for how, patterns in EXPECTED[name].items():
        for pattern in patterns:
            _expect(layout, pattern, how)

    # Against the checkpoint itself: layer 0's q_proj and v_proj rows, and the embedding rows.
    checkpoint = {k: v for k, v in iter_safetensors(path)
                  if k in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                           "model.layers.0.self_attn.v_proj.weight")}
    embed = torch.cat([r["model.embed_tokens.weight"] for r in ranks])
    assert torch.equal(embed[: checkpoint["model.embed_tokens.weight"].shape[0]],
                       checkpoint["model.embed_tokens.weight"].double())
    if "model.layers.0.self_attn.q_proj.weight" in checkpoint:  # MHA / GQA (not MLA)
        qkv = [m.get_submodule("model.layers.0.self_attn.qkv_proj") for m in rank_models]
        q = torch.cat([m.split(m.weight.T)[0].T for m in qkv])
        assert torch.equal(q, checkpoint["model.layers.0.self_attn.q_proj.weight"].double())
        v = [m.split(m.weight.T)[2].T for m in qkv]
        want_v = checkpoint["model.layers.0.self_attn.v_proj.weight"].double()
        assert torch.equal(v[0], want_v) if name == "draft-model-tiny" else torch.equal(torch.cat(v), want_v)
