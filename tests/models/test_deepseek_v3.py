"""DeepSeek-V3 / Kimi-K2 (MLA + MoE) over the paged cache versus transformers, in float64."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from paged_reference import assert_traces_match, specdec_greedy, transformers_greedy
from specdec.backends import get_backend
from specdec.cache import MLAPool, PagedKVCache
from specdec.runtime.model_runner import Chunk, ModelRunner
from specdec.models import CheckpointError, load_model
from specdec.models.deepseek_v3 import DeepseekV3ForCausalLM as OurDeepseekV3
from specdec.models.deepseek_v3 import mla_softmax_scale

VOCAB = 96
STEPS = 20
AUX_IDS = (0, 1, 2)
# Ragged prompts spanning several 16-token pages (and two 64-token pages with the decode steps).
PROMPT_LENS = (37, 5, 50)

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=10,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=3,
    max_position_embeddings=128,
    # transformers' grouped-GEMM experts have no float64 kernel; batched_mm is its exact float64 path
    # (eager is the same maths but spends seconds in CPU index_add_).
    experts_implementation="batched_mm",
)

# Weight scales are chosen so greedy decoding moves between tokens while transformers' float32
# islands (norms, router) stay well inside the 1e-6 bar (measured: 1.6e-7 and 4.1e-7 relative).
# Larger embeddings make the next token depend on the current one; with tied embeddings they would
# make every token predict itself, so that variant uses wider weights instead.
EMBED_SCALE = {"qlora_yarn": 5.0, "plain_tied": 1.0}

VARIANTS = {
    # q_lora, YaRN whose mscale_all_dim rescales the softmax, interleaved RoPE, group-limited routing.
    "qlora_yarn": dict(
        initializer_range=0.1,
        q_lora_rank=12,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=32,
            mscale=1.0,
            mscale_all_dim=0.8,
            beta_fast=32.0,
            beta_slow=1.0,
        ),
        rope_interleave=True,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_mtp_layers=1,  # transformers' default; the MTP layer's tensors (if saved) are skipped
    ),
    # Plain q_proj, default NeoX RoPE, tied embeddings, biases, one group, no renormalisation.
    "plain_tied": dict(
        initializer_range=0.2,
        q_lora_rank=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        rope_interleave=False,
        tie_word_embeddings=True,
        attention_bias=True,
        n_group=1,
        topk_group=1,
        n_shared_experts=2,
        first_k_dense_replace=2,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
        num_mtp_layers=0,
    ),
}


def _randomise(model: DeepseekV3ForCausalLM, seed: int, embed_scale: float = 1.0) -> None:
    """Non-trivial norms, biases and router corrections, so a tensor loaded into the wrong slot shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(embed_scale)
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            noise = torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype)
            if name.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.2 * noise)
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(0.3 * noise)  # moves the selection, not the mixing weights
            elif name.endswith(".bias"):
                tensor.copy_(0.1 * noise)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    """(name, checkpoint folder, transformers reference trace), built once per variant."""
    torch.manual_seed(0)
    config = DeepseekV3Config(**BASE, **VARIANTS[request.param])
    hf = DeepseekV3ForCausalLM(config).to(torch.float64).eval()
    _randomise(hf, seed=2, embed_scale=EMBED_SCALE[request.param])
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    reference = transformers_greedy(hf, _prompts(), STEPS, aux_layer_ids=AUX_IDS)
    return request.param, folder, reference


@pytest.fixture(scope="module")
def qlora_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    config = DeepseekV3Config(**BASE, **VARIANTS["qlora_yarn"])
    hf = DeepseekV3ForCausalLM(config).to(torch.float64)
    _randomise(hf, seed=3, embed_scale=EMBED_SCALE["qlora_yarn"])
    folder = tmp_path_factory.mktemp("qlora_ckpt")
    hf.save_pretrained(folder, safe_serialization=True)
    return folder


def _rewrite(src, dst, edit_tensors=None, edit_config=None):
    """Copy a checkpoint folder, editing its tensor dict and/or config dict on the way."""
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _short_trace(model, steps=2):
    return specdec_greedy(model, _prompts(), steps, block_size=16, aux_layer_ids=AUX_IDS)


def _assert_same_model(a, b):
    ta, tb = _short_trace(a), _short_trace(b)
    assert ta.tokens == tb.tokens
    for la, lb in zip(ta.logits, tb.logits):
        for x, y in zip(la, lb):
            torch.testing.assert_close(x, y, rtol=0, atol=0)


# ----- numerics versus transformers -----


@pytest.mark.parametrize("block_size", [16, 1, 64])
def test_paged_prefill_and_decode_match_transformers(variant, block_size):
    name, folder, reference = variant
    model = load_model(folder, dtype="float64")
    ours = specdec_greedy(model, _prompts(), STEPS, block_size=block_size, aux_layer_ids=AUX_IDS)
    assert_traces_match(ours, reference)
    # Guard against a degenerate reference: greedy decoding must move between tokens.
    assert all(len(set(tokens)) > 3 for tokens in reference.tokens), reference.tokens


def test_chunked_prefill_matches_one_shot_prefill(qlora_ckpt):
    """Multi-token queries over an existing cache (chunked prefill, the verify shape) see the right keys."""
    model = load_model(qlora_ckpt, dtype="float64")
    prompts = _prompts()

    def run(splits):
        cache = PagedKVCache(1 << 24)
        pools = [cache.register(p) for p in model.kv_pools("target", 16, torch.float64)]
        cache.build()
        runner = ModelRunner(model, cache, get_backend("torch"), [p.name for p in pools])
        outs = []
        for lo, hi in splits:
            chunks = [Chunk(i, p[lo(p) : hi(p)]) for i, p in enumerate(prompts)]
            outs.append(runner.forward(chunks).hidden_states.split([len(c.token_ids) for c in chunks]))
        return [torch.cat([out[i] for out in outs]) for i in range(len(prompts))]

    whole = run([(lambda p: 0, len)])
    # Ragged split points: every request continues a cached prefix with several new queries.
    chunked = run([(lambda p: 0, lambda p: len(p) // 3), (lambda p: len(p) // 3, len)])
    for a, b in zip(chunked, whole):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_structure_follows_the_config(variant):
    name, folder, _ = variant
    model = load_model(folder, dtype="float64")
    settings = VARIANTS[name]
    moe = [hasattr(layer.mlp, "gate") for layer in model.model.layers]
    k = settings["first_k_dense_replace"]
    assert moe == [i >= k for i in range(BASE["num_hidden_layers"])]
    attn = model.model.layers[0].self_attn
    assert hasattr(attn, "q_proj") == (settings["q_lora_rank"] is None)
    assert (model.lm_head is None) == bool(settings.get("tie_word_embeddings"))
    [pool] = model.kv_pools("target", 16, torch.float64)
    assert isinstance(pool, MLAPool) and pool.name == "target"
    assert pool.num_layers == 3 and pool.entries == {"latent": (16 + 8,)}


def test_yarn_mscale_all_dim_scales_the_softmax():
    config = DeepseekV3Config(**BASE, **VARIANTS["qlora_yarn"])
    mscale = 0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1.0
    assert mla_softmax_scale(config) == pytest.approx(18**-0.5 * mscale**2)
    plain = DeepseekV3Config(**BASE, **VARIANTS["plain_tied"])
    assert mla_softmax_scale(plain) == pytest.approx(18**-0.5)


def test_aux_ids_out_of_range_are_rejected(qlora_ckpt):
    model = load_model(qlora_ckpt, dtype="float64")
    with pytest.raises(ValueError, match="out of range.*0..2"):
        specdec_greedy(model, _prompts(), 1, aux_layer_ids=(3,))


# ----- checkpoint layouts -----


def test_fused_expert_tensors_load_like_per_expert_ones(qlora_ckpt, tmp_path):
    def fuse(tensors):
        for layer in (1, 2):
            prefix = f"model.layers.{layer}.mlp.experts"
            gate_up, down = [], []
            for e in range(BASE["n_routed_experts"]):
                gate = tensors.pop(f"{prefix}.{e}.gate_proj.weight")
                gate_up.append(torch.cat([gate, tensors.pop(f"{prefix}.{e}.up_proj.weight")]))
                down.append(tensors.pop(f"{prefix}.{e}.down_proj.weight"))
            tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
            tensors[f"{prefix}.down_proj"] = torch.stack(down)

    fused = _rewrite(qlora_ckpt, tmp_path / "fused", edit_tensors=fuse)
    _assert_same_model(load_model(fused, dtype="float64"), load_model(qlora_ckpt, dtype="float64"))


def test_mtp_layer_tensors_are_skipped(qlora_ckpt, tmp_path):
    def add_mtp(tensors):
        mtp = "model.layers.3"  # num_hidden_layers = 3: the first MTP module
        tensors[f"{mtp}.eh_proj.weight"] = torch.randn(32, 64, dtype=torch.float64)
        tensors[f"{mtp}.enorm.weight"] = torch.ones(32, dtype=torch.float64)
        tensors[f"{mtp}.mlp.experts.0.gate_proj.weight"] = torch.randn(16, 32, dtype=torch.float64)
        tensors[f"{mtp}.shared_head.head.weight"] = torch.randn(VOCAB, 32, dtype=torch.float64)

    with_mtp = _rewrite(qlora_ckpt, tmp_path / "mtp", edit_tensors=add_mtp)
    _assert_same_model(load_model(with_mtp, dtype="float64"), load_model(qlora_ckpt, dtype="float64"))


def test_kimi_k2_config_with_legacy_rope_keys_loads(qlora_ckpt, tmp_path):
    def as_kimi(config):
        # How the hub's Kimi-K2 configs spell things: remote-code model_type, rope_theta/rope_scaling,
        # explicit routing keys, moe_layer_freq.
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
        config.update(
            model_type="kimi_k2",
            auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            moe_layer_freq=1,
        )

    kimi = _rewrite(qlora_ckpt, tmp_path / "kimi", edit_config=as_kimi)
    model = load_model(kimi, dtype="float64")
    assert model.hf_config.model_type == "kimi_k2"
    _assert_same_model(model, load_model(qlora_ckpt, dtype="float64"))


def test_moe_layer_freq_interleaves_dense_layers():
    settings = {**BASE, **VARIANTS["plain_tied"], "num_hidden_layers": 5, "first_k_dense_replace": 1}
    config = DeepseekV3Config(**settings)
    config.moe_layer_freq = 2
    model = OurDeepseekV3(config)
    assert [hasattr(layer.mlp, "gate") for layer in model.model.layers] == [False, False, True, False, True]


def test_bfloat16_keeps_the_router_in_float32(qlora_ckpt):
    model = load_model(qlora_ckpt, dtype="bfloat16")
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    reference = load_file(str(qlora_ckpt / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"]
    torch.testing.assert_close(gate.e_score_correction_bias, reference.float())
    trace = specdec_greedy(model, _prompts(), 2)
    assert all(torch.isfinite(row).all() for rows in trace.logits for row in rows)


# ----- errors -----


def test_missing_tensor_is_named(qlora_ckpt, tmp_path):
    name = "model.layers.0.self_attn.kv_a_layernorm.weight"
    folder = _rewrite(qlora_ckpt, tmp_path / "c", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing.*{name}"):
        load_model(folder, dtype="float64")


def test_missing_router_bias_is_named(qlora_ckpt, tmp_path):
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    folder = _rewrite(qlora_ckpt, tmp_path / "c", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing.*{name}"):
        load_model(folder, dtype="float64")


def test_missing_single_expert_is_named(qlora_ckpt, tmp_path):
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    folder = _rewrite(qlora_ckpt, tmp_path / "c", edit_tensors=lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing.*{name}"):
        load_model(folder, dtype="float64")


def test_unexpected_tensor_is_named(qlora_ckpt, tmp_path):
    def add(tensors):
        tensors["model.layers.1.mlp.experts.8.up_proj.weight"] = torch.zeros(16, 32, dtype=torch.float64)

    folder = _rewrite(qlora_ckpt, tmp_path / "c", edit_tensors=add)
    with pytest.raises(CheckpointError, match=r"unexpected.*experts\.8\.up_proj"):
        load_model(folder, dtype="float64")


@pytest.mark.parametrize(
    "name", ["model.layers.0.self_attn.kv_b_proj.weight", "model.layers.2.mlp.experts.3.down_proj.weight"]
)
def test_shape_mismatch_is_named(qlora_ckpt, tmp_path, name):
    def shrink(tensors):
        tensors[name] = tensors[name][:, :-1].contiguous()

    folder = _rewrite(qlora_ckpt, tmp_path / "c", edit_tensors=shrink)
    with pytest.raises(CheckpointError, match=rf"{name}.*shape"):
        load_model(folder, dtype="float64")


def test_folder_without_config_json(qlora_ckpt, tmp_path):
    folder = tmp_path / "weights_only"
    folder.mkdir()
    shutil.copy(qlora_ckpt / "model.safetensors", folder)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(folder)


def test_unknown_model_type_lists_supported(qlora_ckpt, tmp_path):
    folder = _rewrite(qlora_ckpt, tmp_path / "c", edit_config=lambda c: c.update(model_type="deepseek_v9"))
    with pytest.raises(ValueError, match="deepseek_v9.*supported:.*deepseek_v3.*kimi_k2"):
        load_model(folder)


@pytest.mark.parametrize(
    "extra, message",
    [
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
        (dict(topk_method="greedy"), "topk_method='greedy'"),
        (dict(quantization_config={"quant_method": "fp8"}), "quantized checkpoints"),
        (dict(n_group=3), "n_group"),
    ],
)
def test_unsupported_configs_fail_at_construction(extra, message):
    config = DeepseekV3Config(**BASE, **{**VARIANTS["qlora_yarn"], **extra})
    with pytest.raises(ValueError, match=message):
        OurDeepseekV3(config)
