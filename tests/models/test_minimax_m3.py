"""MiniMax-M3 over the paged cache versus transformers' MiniMaxM3VLForCausalLM, in float64.

The tiny config keeps transformers' 128-token indexer blocks but selects only 2 of them per query
(1 local + 1 by score), so the 300- and 520-token prompts really drop blocks while the 90-token one
fits inside its selection.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.minimax_m3_vl import (
    MiniMaxM3SparseForConditionalGeneration,
    MiniMaxM3VLConfig,
    MiniMaxM3VLForCausalLM,
    MiniMaxM3VLTextConfig,
)
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb

from specdec.cache import PagedKVCache
from specdec.runtime.model_runner import Chunk, ModelRunner, last_token_indices
from specdec.backends import get_backend, invariance, ragged
from specdec.models import CheckpointError, load_model
from specdec.backends.base import AttentionMetadata
from specdec.backends.block_sparse import block_sparse_attention
from specdec.models.minimax_m3 import MiniMaxM3ForCausalLM, rotate_prefix
from paged_reference import assert_traces_match, specdec_greedy, transformers_greedy

VOCAB = 96
BLOCK = 128
PROMPT_LENS = (520, 300, 90)


def tiny_text_config(**overrides) -> MiniMaxM3VLTextConfig:
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        dense_intermediate_size=24,
        shared_intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        index_n_heads=2,
        index_head_dim=16,
        index_block_size=BLOCK,
        index_topk_blocks=2,
        index_local_blocks=1,
        layer_types=["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    return MiniMaxM3VLTextConfig(**settings)


def randomise(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights far from the (1 + 0)-norm, zero-bias init, so unit offsets and biases matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = 0.3 if "norm" in name else 0.15
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * std)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=gen, dtype=b.dtype) * 0.1)


def reference(path):
    return MiniMaxM3VLForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation="sdpa", experts_implementation="batched_mm"
    ).eval()


def prompts(lengths=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def text_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("m3_text")
    model = MiniMaxM3VLForCausalLM(tiny_text_config()).double()
    randomise(model)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def ours(text_ckpt):
    return load_model(text_ckpt, dtype="float64")


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory, text_ckpt):
    """The same language model inside a MiniMaxM3SparseForConditionalGeneration checkpoint."""
    path = tmp_path_factory.mktemp("m3_vl")
    text = reference(text_ckpt)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=2)
    config = MiniMaxM3VLConfig(text_config=text.config.to_dict(), vision_config=vision, projector_hidden_size=16)
    full = MiniMaxM3SparseForConditionalGeneration(config).double()
    full.model.language_model.load_state_dict(text.model.state_dict())
    full.lm_head.load_state_dict(text.lm_head.state_dict())
    full.save_pretrained(path, safe_serialization=True)
    return path


def prefill_logits(model, batch, chunks_per_prompt=1):
    """Last-token logits after prefilling ``batch``, optionally in several chunks per prompt."""
    cache = PagedKVCache(1 << 24)
    pools = [cache.register(p) for p in model.kv_pools("target", BLOCK, torch.float64)]
    cache.build()
    runner = ModelRunner(model, cache, get_backend("torch"), [p.name for p in pools])
    bounds = [torch.linspace(0, len(p), chunks_per_prompt + 1).long().tolist() for p in batch]
    for c in range(chunks_per_prompt):
        chunks = [Chunk(i, p[b[c] : b[c + 1]]) for i, (p, b) in enumerate(zip(batch, bounds))]
        out = runner.forward(chunks)
    return model.compute_logits(out.hidden_states[last_token_indices(chunks)])


# ----- numerics -----
def test_matches_transformers_sparse_and_dense_layers(text_ckpt, ours):
    batch = prompts()
    aux = (0, 1, 2)
    mine = specdec_greedy(ours, batch, 20, block_size=BLOCK, aux_layer_ids=aux)
    theirs = transformers_greedy(reference(text_ckpt), batch, 20, aux_layer_ids=aux)
    assert_traces_match(mine, theirs)


def test_block_selection_really_drops_blocks(ours):
    """With every block selectable the long prompts' logits change, the short one's do not."""
    batch = prompts()
    sparse = prefill_logits(ours, batch)
    indexers = [layer.self_attn.indexer for layer in ours.model.layers if layer.self_attn.indexer is not None]
    try:
        for ix in indexers:
            ix.topk_blocks = 64
        dense = prefill_logits(ours, batch)
    finally:
        for ix in indexers:
            ix.topk_blocks = 2
    change = (sparse - dense).abs().amax(-1) / dense.abs().amax(-1)
    assert change[0] > 1e-3 and change[1] > 1e-3
    # The short prompt selects the same blocks either way; only float64 summation order may differ.
    assert change[2] < 1e-12


def test_the_indexer_scores_only_where_it_can_drop_a_block(ours, monkeypatch):
    """A forward whose requests hold at most ``index_topk_blocks`` blocks of keys keeps every block it
    can see: the indexer writes its keys but returns no mask, and the logits are what scoring gives."""
    masks = []
    indexer = type(next(l.self_attn.indexer for l in ours.model.layers if l.self_attn.indexer is not None))
    forward = indexer.forward
    monkeypatch.setattr(indexer, "forward", lambda self, *args: masks.append(forward(self, *args)) or masks[-1])
    batch = prompts()  # 520 and 300 tokens: more than 2 blocks of 128
    short = 2
    beside_long = prefill_logits(ours, batch)[short]
    assert all(mask is not None for mask in masks)
    masks.clear()
    alone = prefill_logits(ours, [batch[short]])[0]  # 90 tokens: one block
    assert masks and all(mask is None for mask in masks)
    torch.testing.assert_close(alone, beside_long, rtol=1e-12, atol=1e-12)
    with invariance.batch_invariant():  # there a request's logits may not depend on its companions at all
        assert torch.equal(prefill_logits(ours, [batch[short]])[0], prefill_logits(ours, batch)[short])


def test_chunked_prefill_selects_from_cached_indexer_keys(ours):
    batch = prompts()
    one_shot = prefill_logits(ours, batch)
    chunked = prefill_logits(ours, batch, chunks_per_prompt=3)
    torch.testing.assert_close(chunked, one_shot, rtol=1e-10, atol=1e-10)


def staggered_greedy(model, batch, steps):
    """Greedy decoding where prompt 0 arrives one step late, so its whole prefill shares a forward with
    the others' first decode step. Returns every request's tokens and the logits that chose them."""
    cache = PagedKVCache(1 << 24)
    pools = [cache.register(p) for p in model.kv_pools("target", BLOCK, torch.float64)]
    cache.build()
    runner = ModelRunner(model, cache, get_backend("torch"), [p.name for p in pools])
    tokens, logits = {i: [] for i in range(len(batch))}, {i: [] for i in range(len(batch))}
    chunks = [Chunk(i, batch[i]) for i in range(1, len(batch))]
    while chunks:
        out = runner.forward(chunks)
        for chunk, row in zip(chunks, model.compute_logits(out.hidden_states[last_token_indices(chunks)])):
            tokens[chunk.request].append(int(row.argmax()))
            logits[chunk.request].append(row)
        chunks = [Chunk(i, [tokens[i][-1]]) for i in range(1, len(batch)) if len(tokens[i]) < steps]
        late = Chunk(0, [tokens[0][-1]]) if tokens[0] else Chunk(0, batch[0])
        chunks += [late] if len(tokens[0]) < steps else []
    return [tokens[i] for i in range(len(batch))], [torch.stack(logits[i]) for i in range(len(batch))]


def test_a_prompt_prefilled_beside_decoding_requests(text_ckpt, ours, monkeypatch):
    """One forward holds the others' 1-token queries and a 520-token prefill: attention and the indexer
    cut it into groups of close query lengths (backends.ragged), which changes nothing but the work."""
    cut = []
    compute = ragged._compute_query_groups
    monkeypatch.setattr(ragged, "_compute_query_groups", lambda meta: cut.append(compute(meta)) or cut[-1])
    batch, steps = prompts(), 4
    tokens, logits = staggered_greedy(ours, batch, steps)
    assert any(groups is not None and len(groups) == 2 for groups in cut)  # the mixed forward was cut
    assert tokens == transformers_greedy(reference(text_ckpt), batch, steps).tokens
    monkeypatch.setattr(ragged, "SLACK", 10**9)  # every batch padded whole
    cut.clear()
    whole_tokens, whole_logits = staggered_greedy(ours, batch, steps)
    assert whole_tokens == tokens and all(groups is None for groups in cut)
    for mine, whole in zip(logits, whole_logits):
        torch.testing.assert_close(mine, whole, rtol=1e-10, atol=1e-10)


def test_multimodal_checkpoint_serves_its_language_model(vl_ckpt, ours):
    config = json.loads((vl_ckpt / "config.json").read_text())
    assert config["model_type"] == "minimax_m3_vl"
    vl = load_model(vl_ckpt, dtype="float64")
    assert isinstance(vl, MiniMaxM3ForCausalLM)
    batch = prompts((300, 40), seed=3)
    torch.testing.assert_close(prefill_logits(vl, batch), prefill_logits(ours, batch), rtol=0, atol=0)


@pytest.mark.parametrize("index_dim, rotary", [(16, 8), (16, 16), (8, 16)])
def test_indexer_rope_follows_the_reference_table_slicing(index_dim, rotary):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, index_dim, generator=gen, dtype=torch.float64)
    freqs = torch.rand(5, rotary // 2, generator=gen, dtype=torch.float64) * 3
    cos, sin = freqs.cos(), freqs.sin()
    emb_cos, emb_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    # transformers: [B, H, S, D] with the main table sliced to the indexer's head size.
    expected, _ = apply_rotary_pos_emb(
        x.transpose(0, 1)[None], x.transpose(0, 1)[None], emb_cos[None, ..., :index_dim], emb_sin[None, ..., :index_dim]
    )
    got = rotate_prefix(x, emb_cos, emb_sin, min(index_dim, rotary))
    torch.testing.assert_close(got, expected[0].transpose(0, 1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("heads, kv_heads, groups", [(4, 2, 2), (8, 2, 4), (8, 4, 2), (4, 2, 1)])
def test_block_sparse_attention_gives_each_head_group_its_own_keys(heads, kv_heads, groups):
    """Against a per-head dense softmax; a tree mask already in the metadata is ANDed in."""
    gen = torch.Generator().manual_seed(heads + groups)
    page, dim, seq_lens, query_lens = 4, 8, [11, 6], [3, 6]
    k_cache = torch.randn(6, page, kv_heads, dim, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(6, page, kv_heads, dim, generator=gen, dtype=torch.float64)
    tables = torch.tensor([[4, 0, 2], [5, 1, 3]], dtype=torch.int32)
    num_tokens = sum(query_lens)
    tree = torch.rand(num_tokens, 11, generator=gen) > 0.3
    meta = AttentionMetadata.build(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=tables,
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        block_size=page,
        custom_mask=tree,
    )
    q = torch.randn(num_tokens, heads, dim, generator=gen, dtype=torch.float64)
    keep = torch.rand(num_tokens, groups, 11, generator=gen) > 0.4
    keep[..., 0] = True  # every query keeps some visible key
    got = block_sparse_attention(get_backend("torch"), q, k_cache, v_cache, meta, keep, scale=0.3)

    expected = torch.empty_like(got)
    row = 0
    for r, (s, n) in enumerate(zip(seq_lens, query_lens)):
        keys = k_cache[tables[r].long()].reshape(-1, kv_heads, dim)[:s]
        values = v_cache[tables[r].long()].reshape(-1, kv_heads, dim)[:s]
        for j in range(n):
            t, pos = row + j, s - n + j
            for h in range(heads):
                allowed = keep[t, h // (heads // groups), :s] & tree[t, :s] & (torch.arange(s) <= pos)
                kv = h // (heads // kv_heads)
                scores = (keys[:, kv] @ q[t, h]) * 0.3
                probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=0).nan_to_num(0.0)
                expected[t, h] = probs @ values[:, kv]
        row += n
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


# ----- cache layout -----
def test_kv_pools_need_128_token_pages_and_keep_indexer_keys(ours):
    with pytest.raises(ValueError, match="128-token KV pages"):
        ours.kv_pools("target", 16, torch.float64)
    main, index = ours.kv_pools("target", BLOCK, torch.float64)
    assert ours.required_block_size == BLOCK
    assert (main.name, main.num_layers, main.entries["k"]) == ("target", 3, (2, 16))
    assert (index.name, index.num_layers, index.entries) == ("target.index", 2, {"k": (16,)})
    assert index.block_size == main.block_size == BLOCK


# ----- configs -----
def test_legacy_sparse_attention_config_keys():
    config = MiniMaxM3VLTextConfig(
        **{
            **tiny_text_config().to_dict(),
            "layer_types": None,
            "mlp_layer_types": None,
            "index_topk_blocks": 16,
            "sparse_attention_config": {
                "sparse_attention_freq": [1, 0, 1],
                "sparse_topk_blocks": 3,
                "sparse_num_index_heads": 2,
                "sparse_index_dim": 16,
                "sparse_block_size": 128,
                "sparse_local_block": 1,
            },
            "moe_layer_freq": [0, 1, 1],
        }
    )
    with torch.device("meta"):
        model = MiniMaxM3ForCausalLM(config)
    assert model.attention_types == ["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"]
    assert model.mlp_types == ["dense", "sparse", "sparse"]
    assert model.model.layers[0].self_attn.indexer.topk_blocks == 3
    assert model.model.layers[1].self_attn.indexer is None


def test_bad_configs_are_rejected_with_the_fix():
    with torch.device("meta"):
        with pytest.raises(ValueError, match="index_n_heads"):
            MiniMaxM3ForCausalLM(tiny_text_config(index_n_heads=3))
        with pytest.raises(ValueError, match="index_topk_blocks"):
            MiniMaxM3ForCausalLM(tiny_text_config(index_topk_blocks=1, index_local_blocks=2))
        with pytest.raises(ValueError, match="layer_types"):
            MiniMaxM3ForCausalLM(tiny_text_config(layer_types=["sliding_attention"] * 3))


# ----- loader errors -----
def _copy_with(tmp_path, ckpt, edit):
    dest = tmp_path / "ckpt"
    shutil.copytree(ckpt, dest)
    tensors = load_file(dest / "model.safetensors")
    edit(tensors)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_missing_tensor_is_named(tmp_path, text_ckpt):
    name = "model.layers.2.self_attn.indexer.k_proj.weight"
    path = _copy_with(tmp_path, text_ckpt, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing.*indexer.k_proj"):
        load_model(path, dtype="float64")


def test_missing_expert_piece_of_a_hub_checkpoint_is_named(tmp_path, vl_ckpt):
    name = "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight"
    path = _copy_with(tmp_path, vl_ckpt, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.experts\.down_proj \(3 of 4"):
        load_model(path, dtype="float64")


def test_unexpected_tensor_is_named(tmp_path, text_ckpt):
    extra = {"model.layers.1.self_attn.indexer.q_proj.weight": torch.zeros(32, 32)}  # layer 1 is full attention
    path = _copy_with(tmp_path, text_ckpt, lambda t: t.update(extra))
    with pytest.raises(CheckpointError, match="unexpected.*layers.1.self_attn.indexer"):
        load_model(path, dtype="float64")


def test_split_gate_and_up_load_like_the_fused_tensor(tmp_path, text_ckpt):
    """Dense and shared-expert MLPs saved as gate_proj / up_proj (the hub spelling) load the same rows."""

    def split(tensors):
        for name in [n for n in tensors if n.endswith("gate_up_proj.weight") and ".experts." not in n]:
            gate, up = tensors.pop(name).chunk(2, dim=0)
            module = name.removesuffix(".gate_up_proj.weight")
            tensors[f"{module}.gate_proj.weight"], tensors[f"{module}.up_proj.weight"] = gate, up

    fused = load_model(text_ckpt, dtype="float64")
    split_model = load_model(_copy_with(tmp_path, text_ckpt, split), dtype="float64")
    for (name, a), (_, b) in zip(fused.state_dict().items(), split_model.state_dict().items()):
        assert torch.equal(a, b), name
    missing = _copy_with(tmp_path / "missing", text_ckpt, lambda t: (split(t), t.pop("model.layers.0.mlp.up_proj.weight")))
    with pytest.raises(CheckpointError, match=r"gate_up_proj\.weight \(1 of 2 pieces\): model\.layers\.0\.mlp\.up_proj"):
        load_model(missing, dtype="float64")


def test_shape_mismatch_is_named(tmp_path, text_ckpt):
    name = "model.layers.0.mlp.gate_up_proj.weight"
    path = _copy_with(tmp_path, text_ckpt, lambda t: t.update({name: torch.zeros(40, 32)}))
    with pytest.raises(CheckpointError, match=r"gate_up_proj.*\(40, 32\).*\(48, 32\)"):
        load_model(path, dtype="float64")


def test_folder_without_config_and_unknown_model_type(tmp_path, text_ckpt):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path / "empty")
    dest = tmp_path / "other"
    shutil.copytree(text_ckpt, dest)
    (dest / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*minimax_m3_vl_text"):
        load_model(dest)
