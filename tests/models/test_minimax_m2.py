"""MiniMax-M2 over the paged cache versus transformers' MiniMaxM2ForCausalLM, in float64."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from paged_reference import assert_traces_match, specdec_greedy, transformers_greedy
from safetensors.torch import load_file, save_file
from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

from specdec.backends import get_backend
from specdec.cache import PagedKVCache
from specdec.runtime.model_runner import Chunk, ModelRunner, last_token_indices
from specdec.models import CheckpointError, load_model
from specdec.models.minimax_m2 import MiniMaxM2ForCausalLM as OurMiniMaxM2

VOCAB = 96
BLOCK = 16
# Ragged, each spanning several 16-token pages (and one inside a single page).
PROMPT_LENS = (45, 7, 29)


def tiny_config(**overrides) -> MiniMaxM2Config:
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=6,
        num_experts_per_tok=2,
        rotary_dim=4,  # the hub's spelling; transformers turns it into partial_rotary_factor 0.5
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    return MiniMaxM2Config(**settings)


def build(path, config, seed: int = 0):
    model = MiniMaxM2ForCausalLM(config).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            # Norms away from 1 and a non-zero correction bias, so both must be loaded and applied.
            p.copy_(1 + 0.3 * noise if "norm" in name else 0.15 * noise)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=gen, dtype=b.dtype) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


def reference(path):
    return MiniMaxM2ForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation="sdpa", experts_implementation="batched_mm"
    ).eval()


def prompts(lengths=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def prefill_logits(model, batch):
    cache = PagedKVCache(1 << 22)
    pools = [cache.register(p) for p in model.kv_pools("target", BLOCK, torch.float64)]
    cache.build()
    runner = ModelRunner(model, cache, get_backend("torch"), [p.name for p in pools])
    chunks = [Chunk(i, p) for i, p in enumerate(batch)]
    return model.compute_logits(runner.forward(chunks).hidden_states[last_token_indices(chunks)])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build(tmp_path_factory.mktemp("m2"), tiny_config())


@pytest.fixture(scope="module")
def ours(ckpt):
    return load_model(ckpt, dtype="float64")


# ----- numerics -----
def test_matches_transformers_prefill_and_decode(ckpt, ours):
    batch = prompts()
    aux = (0, 1, 2)
    mine = specdec_greedy(ours, batch, 20, block_size=BLOCK, aux_layer_ids=aux)
    theirs = transformers_greedy(reference(ckpt), batch, 20, aux_layer_ids=aux)
    assert_traces_match(mine, theirs)


def test_partial_rope_and_whole_width_qk_norm(ours):
    attn = ours.model.layers[0].self_attn
    assert ours.model.rotary_emb.rotary_dim == 4
    assert attn.q_norm.weight.shape == (4 * 8,) and attn.k_norm.weight.shape == (2 * 8,)


def test_tied_embeddings(tmp_path):
    path = build(tmp_path / "tied", tiny_config(tie_word_embeddings=True, num_hidden_layers=1), seed=2)
    model = load_model(path, dtype="float64")
    assert model.lm_head is None
    batch = prompts((20, 9), seed=4)
    assert_traces_match(
        specdec_greedy(model, batch, 3, block_size=BLOCK), transformers_greedy(reference(path), batch, 3)
    )


# ----- checkpoint spellings -----
def test_fused_expert_spelling_loads_the_same_model(tmp_path, ckpt, ours):
    """transformers' in-memory names (fused experts, ``mlp.*``) as some converters save them."""
    dest = tmp_path / "fused"
    shutil.copytree(ckpt, dest)
    state = {k: v.contiguous() for k, v in reference(ckpt).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and "model.layers.0.mlp.e_score_correction_bias" in state
    save_file(state, dest / "model.safetensors", metadata={"format": "pt"})
    fused = load_model(dest, dtype="float64")
    batch = prompts()
    torch.testing.assert_close(prefill_logits(fused, batch), prefill_logits(ours, batch), rtol=0, atol=0)


def test_legacy_hub_config_keys(tmp_path, ckpt, ours):
    """Old hub configs: top-level rope_theta and rotary_dim, no rope_parameters."""
    dest = tmp_path / "legacy"
    shutil.copytree(ckpt, dest)
    config = json.loads((dest / "config.json").read_text())
    config.pop("rope_parameters")
    config.update(rope_theta=5e6, rotary_dim=4)
    (dest / "config.json").write_text(json.dumps(config))
    legacy = load_model(dest, dtype="float64")
    assert legacy.model.rotary_emb.rotary_dim == 4
    batch = prompts()
    torch.testing.assert_close(prefill_logits(legacy, batch), prefill_logits(ours, batch), rtol=0, atol=0)


def test_aux_ids_out_of_range_are_rejected(ours):
    cache = PagedKVCache(1 << 20)
    pools = [cache.register(p) for p in ours.kv_pools("target", BLOCK, torch.float64)]
    cache.build()
    runner = ModelRunner(ours, cache, get_backend("torch"), [p.name for p in pools])
    with pytest.raises(ValueError, match=r"aux layer id 3 is out of range.*0\.\.2"):
        runner.forward([Chunk(0, [1, 2, 3])], aux_layer_ids=(0, 3))


# ----- loader errors -----
def _copy_with(tmp_path, ckpt, edit):
    dest = tmp_path / "ckpt"
    shutil.copytree(ckpt, dest)
    tensors = load_file(dest / "model.safetensors")
    edit(tensors)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_missing_tensors_are_named(tmp_path, ckpt):
    def drop(t):
        t.pop("model.layers.1.block_sparse_moe.e_score_correction_bias")
        t.pop("model.layers.2.block_sparse_moe.experts.5.w3.weight")

    path = _copy_with(tmp_path, ckpt, drop)
    with pytest.raises(CheckpointError, match=r"missing.*layers\.1\.mlp\.e_score_correction_bias"):
        load_model(path, dtype="float64")
    path = _copy_with(tmp_path / "b", ckpt, lambda t: t.pop("model.layers.2.block_sparse_moe.experts.5.w3.weight"))
    with pytest.raises(CheckpointError, match=r"layers\.2\.mlp\.experts\.gate_up_proj \(11 of 12 pieces\)"):
        load_model(path, dtype="float64")


def test_unexpected_tensors_are_named(tmp_path, ckpt):
    path = _copy_with(tmp_path, ckpt, lambda t: t.update({"model.layers.0.self_attn.sinks": torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=r"unexpected.*layers\.0\.self_attn\.sinks"):
        load_model(path, dtype="float64")
    extra = {"model.layers.0.block_sparse_moe.experts.6.w1.weight": torch.zeros(16, 32)}
    path = _copy_with(tmp_path / "b", ckpt, lambda t: t.update(extra))
    with pytest.raises(CheckpointError, match="expert 6, the model has 6 experts"):
        load_model(path, dtype="float64")


def test_shape_mismatches_are_named(tmp_path, ckpt):
    path = _copy_with(tmp_path, ckpt, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(8)}))
    with pytest.raises(CheckpointError, match=r"q_norm.weight.*\(8,\).*\(32,\)"):
        load_model(path, dtype="float64")
    wrong = {"model.layers.0.block_sparse_moe.experts.0.w2.weight": torch.zeros(16, 32)}
    path = _copy_with(tmp_path / "b", ckpt, lambda t: t.update(wrong))
    with pytest.raises(CheckpointError, match=r"experts\.0\.w2\.weight.*\(16, 32\).*\(32, 16\)"):
        load_model(path, dtype="float64")


def test_folder_without_config_and_unknown_model_type(tmp_path, ckpt):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path / "empty")
    dest = tmp_path / "other"
    shutil.copytree(ckpt, dest)
    (dest / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'.*minimax_m2"):
        load_model(dest)


def test_wrong_model_type_for_the_class():
    with torch.device("meta"), pytest.raises(ValueError, match="serves model_type 'minimax_m2'"):
        OurMiniMaxM2(type("Config", (), {"model_type": "llama"})())
