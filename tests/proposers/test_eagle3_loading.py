"""Loading EAGLE3 drafts: every published layout, weight sharing, the vocab map, and every refusal."""

from __future__ import annotations

import json
import math

import pytest
import torch
from eagle3_reference import (
    DraftSpec,
    draft_config,
    make_weights,
    save_deepseek_target,
    save_llama_target,
    write_draft,
)

from specdec.cache import AttentionPool, MLAPool
from specdec.models import CheckpointError, load_model
from specdec.models.weights import checkpoint_parameters
from specdec.proposers.eagle3 import Eagle3DraftConfig, Eagle3LlamaDraft, load_eagle3_draft


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_target")
    save_llama_target(folder)
    return folder


@pytest.fixture(scope="module")
def target(llama_folder):
    return load_model(llama_folder, dtype="float64")


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_target")
    save_deepseek_target(folder)
    return load_model(folder, dtype="float64")


def load(tmp_path, spec: DraftSpec, target, *, weights=None, config=None, rename=None, method="eagle3"):
    weights = make_weights(spec) if weights is None else weights
    folder = write_draft(tmp_path / "draft", spec, weights, config=config, rename=rename)
    return load_eagle3_draft(folder, target, method=method)


def refused(tmp_path, spec, target, match, **kwargs) -> str:
    with pytest.raises(CheckpointError, match=match) as info:
        load(tmp_path, spec, target, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# ----------------------------------------------------------------------------- layouts
MHA_LAYOUTS = ("eagle", "sglang", "sglang_model", "vllm", "vllm_model")


def checkpoint_state(draft) -> dict[str, torch.Tensor]:
    """The draft's tensors under checkpoint names (packed projections as their parts), buffers included."""
    return {**dict(checkpoint_parameters(draft)), **dict(draft.named_buffers())}


def test_every_layout_loads_the_same_tensors(target, tmp_path):
    spec = DraftSpec(fc_norm=True, draft_vocab=40, own_embed=True)
    weights = make_weights(spec, seed=3)
    for layout in MHA_LAYOUTS:
        layout_spec = DraftSpec(
            layout=layout, fc_norm=True, draft_vocab=40, own_embed=True,
            aux_ids=None if layout == "eagle" else (1, 3, 5),
        )
        draft = load(tmp_path / layout, layout_spec, target, weights=weights)
        assert isinstance(draft, Eagle3LlamaDraft)
        state = checkpoint_state(draft)
        assert set(state) == set(weights), layout
        for name, tensor in weights.items():
            assert torch.equal(state[name], tensor.to(state[name].dtype)), (layout, name)
        assert draft.aux_layer_ids == ((2, 4, 5) if layout == "eagle" else (1, 3, 5))
        assert not any(p.requires_grad for p in draft.parameters())


def test_mla_layout_loads(target, tmp_path):
    spec = DraftSpec(layout="mla", q_lora_rank=12, fc_norm=True, draft_vocab=40)
    weights = make_weights(spec)
    draft = load(tmp_path, spec, target, weights=weights)
    assert draft.is_mla and draft.kv_lora_rank == 16 and draft.qk_rope_head_dim == 4
    state = checkpoint_state(draft)
    assert set(state) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor.to(state[name].dtype)), name


def test_shares_target_embedding_and_lm_head(target, tmp_path):
    draft = load(tmp_path, DraftSpec(own_lm_head=False), target)
    names = {n for n, _ in draft.named_parameters()}
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in names)
    assert draft.lm_head_weight.data_ptr() == target.lm_head.weight.data_ptr()
    ids = torch.tensor([0, 5, 63])
    assert torch.equal(draft.embed(ids), target.embed(ids))


def test_reduced_vocab_takes_the_target_lm_head_rows(target, tmp_path):
    spec = DraftSpec(draft_vocab=24, own_lm_head=False)
    weights = make_weights(spec)
    draft = load(tmp_path, spec, target, weights=weights)
    target_ids = torch.arange(24) + weights["d2t"]
    assert torch.equal(draft.lm_head_weight, target.lm_head.weight[target_ids])


def test_vocab_map(target, tmp_path):
    spec = DraftSpec(draft_vocab=24, with_t2d=False)
    weights = make_weights(spec)
    draft = load(tmp_path, spec, target, weights=weights)
    target_ids = torch.arange(24) + weights["d2t"]
    assert torch.equal(draft.draft_to_target(torch.arange(24)), target_ids)
    assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool
    assert torch.equal(draft.t2d.nonzero().flatten(), target_ids)  # derived from d2t when absent
    logits = torch.randn(2, 24, dtype=torch.float64)
    full = draft.target_logits(logits)
    assert full.shape == (2, 64)
    assert torch.equal(full[:, target_ids], logits)
    assert torch.isinf(full[:, ~draft.t2d]).all()
    assert torch.equal(draft.draft_to_target(logits.argmax(-1)), full.argmax(-1))


def test_full_vocab_without_d2t_is_identity(target, tmp_path):
    draft = load(tmp_path, DraftSpec(), target)
    assert torch.equal(draft.draft_to_target(torch.arange(64)), torch.arange(64))
    assert bool(draft.t2d.all())


def test_config_spellings(tmp_path):
    spec = DraftSpec(aux_ids=(7, 0, 3), fc_norm=True, norm_output=True, flags_in_eagle_config=True)
    config = Eagle3DraftConfig.from_dict(draft_config(spec))
    assert config.aux_layer_ids == (0, 3, 7)  # engines concatenate in ascending layer order
    assert config.fc_norm and config.norm_output and not config.norm_before_residual
    assert config.target_hidden_size == 32 and config.attention == "mha"
    reference = Eagle3DraftConfig.from_dict(draft_config(DraftSpec(layout="eagle", aux_ids=None, draft_vocab=40)))
    assert reference.aux_layer_ids is None and reference.resolve_aux_layer_ids(61) == (2, 30, 58)
    assert reference.draft_vocab_size == 40 and reference.target_hidden_size is None
    mla = Eagle3DraftConfig.from_dict(draft_config(DraftSpec(layout="mla")))
    assert mla.attention == "mla" and mla.q_lora_rank is None and mla.rope_interleave


@pytest.mark.parametrize("name", ["kimi-k2-tiny-eagle3", "kimi-k2-tiny-eagle3.1-mla", "llama-tiny-eagle3",
                                  "llama-tiny-eagle3-unshifted", "minimax-m3-tiny-eagle3"])
def test_config_writes_what_it_reads(name):
    """Training saves drafts through to_dict: every zoo draft's config.json is what to_dict writes, byte for byte."""
    from specdec.zoo import zoo_path

    text = (zoo_path(name) / "config.json").read_text()
    config = Eagle3DraftConfig.from_dict(json.loads(text))
    assert json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n" == text
    assert Eagle3DraftConfig.from_dict(config.to_dict()) == config


def test_dtype_and_device_default_to_the_target(llama_folder, tmp_path):
    target32 = load_model(llama_folder, dtype="float32")
    draft = load(tmp_path, DraftSpec(draft_vocab=40), target32)
    assert draft.fc.weight.dtype == torch.float32 and draft.d2t.dtype == torch.int64


# ----------------------------------------------------------------------------- refusals
def test_fc_width_must_match_target_hidden_times_aux_layers(target, tmp_path):
    spec = DraftSpec(aux_ids=(0, 3, 7))
    config = draft_config(spec)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 7]
    message = refused(tmp_path, spec, target, r"fc\.weight takes 96 inputs", config=config)
    assert "2 aux layers" in message and "fuses 3 layers" in message


def test_target_hidden_size_mismatch(target, tmp_path):
    spec = DraftSpec()
    config = draft_config(spec)
    config["target_hidden_size"] = 48
    refused(tmp_path, spec, target, r"target_hidden_size is 48 but the target's hidden size is 32", config=config)


def test_fc_built_for_another_target_width(target, tmp_path):
    spec = DraftSpec(target_hidden=40)
    config = draft_config(spec)
    del config["target_hidden_size"]
    refused(tmp_path, spec, target, r"fc\.weight takes 120 inputs .* hidden size 32 x 3 aux layers", config=config)


def test_vocab_size_mismatch(target, tmp_path):
    refused(tmp_path, DraftSpec(vocab=80, draft_vocab=40), target, r"vocab_size is 80 but the target's is 64")


def test_draft_vocab_larger_than_vocab(target, tmp_path):
    spec = DraftSpec()
    config = draft_config(spec)
    config["draft_vocab_size"] = 65
    refused(tmp_path, spec, target, r"draft_vocab_size \(65\) exceeds vocab_size \(64\)", config=config)


def test_missing_d2t_with_reduced_vocab(target, tmp_path):
    refused(tmp_path, DraftSpec(draft_vocab=40, with_d2t=False), target, r"no d2t map")


def test_bad_d2t_values(target, tmp_path):
    spec = DraftSpec(draft_vocab=40, with_t2d=False)
    weights = make_weights(spec)
    weights["d2t"][-1] += 100
    refused(tmp_path / "range", spec, target, r"outside the target vocabulary", weights=weights)
    weights = make_weights(spec)
    weights["d2t"][1] = weights["d2t"][0] - 1  # draft ids 0 and 1 now both map to the same target id
    refused(tmp_path / "dup", spec, target, r"two draft ids to the same target id", weights=weights)
    weights = make_weights(spec)
    weights["d2t"] = weights["d2t"][:30]
    refused(tmp_path / "shape", spec, target, r"d2t has shape \[30\], expected \[40\]", weights=weights)


def test_t2d_disagrees_with_d2t(target, tmp_path):
    spec = DraftSpec(draft_vocab=40)
    weights = make_weights(spec)
    weights["t2d"] = ~weights["t2d"]
    refused(tmp_path, spec, target, r"t2d .* disagree", weights=weights)


def test_lm_head_rows_must_be_the_draft_vocab(target, tmp_path):
    spec = DraftSpec(draft_vocab=40)
    config = draft_config(spec)
    config["draft_vocab_size"] = 36
    match = r"lm_head\.weight is \[40, 32\], but the config says draft_vocab_size 36"
    refused(tmp_path, spec, target, match, config=config)


def test_embedding_cannot_be_shared_across_hidden_sizes(target, tmp_path):
    spec = DraftSpec(hidden=24, head_dim=6)
    refused(tmp_path, spec, target, r"no embed_tokens and its hidden_size 24 differs from the target's 32")
    spec = DraftSpec(hidden=24, head_dim=6, own_embed=True, own_lm_head=False)
    refused(tmp_path / "head", spec, target, r"no lm_head and its hidden_size 24 differs")


def test_embedding_shape(target, tmp_path):
    spec = DraftSpec(own_embed=True)
    weights = make_weights(spec)
    weights["embed_tokens.weight"] = weights["embed_tokens.weight"][:60]
    refused(tmp_path, spec, target, r"embed_tokens\.weight is \[60, 32\], expected \[64, 32\]", weights=weights)


def test_mla_method_needs_mla_draft_and_mla_target(target, deepseek, tmp_path):
    refused(tmp_path / "mha", DraftSpec(), deepseek, r"'eagle3\.1-mla' needs an MLA draft", method="eagle3.1-mla")
    mla = DraftSpec(layout="mla")
    match = r"the target .* has no MLA attention: use method 'eagle3'"
    refused(tmp_path / "llama", mla, target, match, method="eagle3.1-mla")
    draft = load(tmp_path / "ok", DraftSpec(layout="mla", aux_ids=(0, 1, 2)), deepseek, method="eagle3.1-mla")
    assert draft.is_mla


def test_mla_latent_must_match_target_pool(deepseek, tmp_path):
    spec = DraftSpec(layout="mla", aux_ids=(0, 1, 2), kv_lora_rank=8)
    refused(tmp_path, spec, deepseek, r"latent \(kv_lora_rank 8 \+ rope 4\) differs from the target's \(16 \+ 4\)",
            method="eagle3.1-mla")
    draft = load(tmp_path / "own", spec, deepseek)  # plain eagle3: fine, with a pool of its own
    with pytest.raises(ValueError, match=r"cannot live in that pool"):
        draft.check_pool(deepseek.kv_pools("target", 16, torch.float64)[0])
    with pytest.raises(ValueError, match=r"needs an MLA pool"):
        draft.check_pool(
            AttentionPool("x", num_layers=1, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float64)
        )
    pool = MLAPool("own", num_layers=1, block_size=4, kv_lora_rank=8, qk_rope_head_dim=4, dtype=torch.float64)
    assert draft.join_pool(pool) == 1 and pool.num_layers == 2


def test_q_lora_rank_must_match_tensors(target, tmp_path):
    spec = DraftSpec(layout="mla", q_lora_rank=12)
    config = draft_config(spec)
    config["q_lora_rank"] = None
    refused(tmp_path / "a", spec, target, r"no q_lora_rank but the checkpoint has q_a_proj \[12, 64\]", config=config)
    spec = DraftSpec(layout="mla")
    config = draft_config(spec)
    config["q_lora_rank"] = 12
    match = r"sets q_lora_rank 12 but the checkpoint has an uncompressed q_proj"
    refused(tmp_path / "b", spec, target, match, config=config)


def test_norm_flags_must_match_tensors(target, tmp_path):
    spec = DraftSpec(fc_norm=True)
    config = draft_config(spec)
    del config["fc_norm"]
    refused(tmp_path / "a", spec, target, r"has fc_norm\.0\.weight but the config does not set fc_norm", config=config)
    weights = make_weights(spec)
    del weights["fc_norm.2.weight"]
    match = r"sets fc_norm: true but the checkpoint lacks fc_norm\.2\.weight"
    refused(tmp_path / "b", spec, target, match, weights=weights)
    spec = DraftSpec(norm_before_fc=True)
    config = draft_config(spec)
    del config["norm_before_fc"]
    match = r"input_norm\.weight but the config does not set norm_before_fc"
    refused(tmp_path / "c", spec, target, match, config=config)
    weights = make_weights(spec)
    del weights["input_norm.weight"]
    refused(tmp_path / "d", spec, target, r"norm_before_fc: true but the checkpoint lacks input_norm", weights=weights)
    config = draft_config(DraftSpec(fc_norm=True, norm_before_fc=True))
    match = r"fc_norm .* and norm_before_fc .* are exclusive"
    refused(tmp_path / "e", DraftSpec(fc_norm=True), target, match, config=config)


def test_flag_spellings_must_agree(target, tmp_path):
    spec = DraftSpec()
    config = draft_config(spec)
    config["norm_output"] = True
    config["eagle_config"]["norm_output"] = False
    refused(tmp_path / "a", spec, target, r"norm_output is True but eagle_config\.norm_output is False", config=config)
    config = draft_config(spec)
    config["fc_norm"] = "yes"
    refused(tmp_path / "b", spec, target, r"fc_norm must be true or false, got 'yes'", config=config)


def test_aux_ids_out_of_range(target, tmp_path):
    message = refused(tmp_path, DraftSpec(aux_ids=(2, 4, 8)), target, r"name layers \[8\] but the target has 8 layers")
    assert "capture-before" in message


def test_default_aux_ids_collide_on_small_targets():
    config = Eagle3DraftConfig.from_dict(draft_config(DraftSpec(layout="eagle", aux_ids=None)))
    with pytest.raises(ValueError, match=r"\(2, 3, 3\) collide"):
        config.resolve_aux_layer_ids(6)
    assert config.resolve_aux_layer_ids(7) == (2, 3, 4)


def test_one_decoder_layer_only(target, tmp_path):
    spec = DraftSpec(layout="vllm")
    config = draft_config(spec)
    config["num_hidden_layers"] = 2
    refused(tmp_path / "cfg", spec, target, r"num_hidden_layers is 2; EAGLE3 drafts have exactly one", config=config)
    weights = make_weights(spec)
    weights["midlayer.extra.weight"] = torch.ones(3, dtype=torch.float64)

    def two_layers(name):
        if name == "midlayer.extra.weight":
            return "layers.1.extra.weight"
        return name.replace("midlayer.", "layers.0.")

    match = r"decoder layers \['layers\.0', 'layers\.1'\]"
    refused(tmp_path / "w", spec, target, match, weights=weights, rename=two_layers)


def test_two_layouts_in_one_checkpoint(target, tmp_path):
    spec = DraftSpec()
    weights = make_weights(spec)
    weights["layers.0.hidden_norm.weight"] = weights["midlayer.hidden_norm.weight"].clone()
    refused(tmp_path, spec, target, r"holds 'midlayer\.hidden_norm\.weight' twice", weights=weights, rename=lambda n: n)


def test_not_a_draft(llama_folder, target):
    with pytest.raises(CheckpointError, match=r"not an EAGLE3 draft: its config is a plain LlamaForCausalLM"):
        load_eagle3_draft(llama_folder, target)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ({"architectures": ["MistralForCausalLM"]}, r"architectures \['MistralForCausalLM'\] is not an EAGLE3 draft"),
        ({"architectures": ["Eagle3Speculator"]}, r"speculators"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, r"use_aux_hidden_state is false"),
        ({"kv_lora_rank": 16}, r"Llama-style \(MHA\) draft but the config has kv_lora_rank"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, -2, 3]}}, r"layer ids >= 0"),
        ({"hidden_size": None}, r"lacks hidden_size"),
    ],
)
def test_bad_configs(edit, match, target, tmp_path):
    spec = DraftSpec()
    config = draft_config(spec)
    config.update(edit)
    refused(tmp_path, spec, target, match, config=config)


def test_unexpected_tensor(target, tmp_path):
    spec = DraftSpec()
    weights = make_weights(spec)
    weights["midlayer.self_attn.q_proj.bias"] = torch.zeros(32, dtype=torch.float64)
    refused(tmp_path, spec, target, r"unexpected tensors .*q_proj\.bias", weights=weights)


def test_unknown_method(target, tmp_path):
    with pytest.raises(ValueError, match=r"unknown EAGLE3 method 'eagle4'; choose one of"):
        load(tmp_path, DraftSpec(), target, method="eagle4")


def test_wrong_widths_at_run_time(target, tmp_path):
    draft = load(tmp_path, DraftSpec(), target)
    with pytest.raises(ValueError, match=r"aux hidden states are 64 wide, the draft's fc takes 96"):
        draft.combine_aux(torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"hidden is 96 wide, the draft takes 32"):
        draft(torch.tensor([1, 2]), torch.tensor([0, 1]), torch.zeros(2, 96, dtype=torch.float64), None)


def test_config_json_is_read_from_the_folder(tmp_path):
    folder = tmp_path / "d"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(draft_config(DraftSpec(layout="mla", q_lora_rank=12))))
    assert Eagle3DraftConfig.from_folder(folder).q_lora_rank == 12


def test_rope_scaling_is_read_from_the_draft_config(target, deepseek, tmp_path):
    """Llama-3.1 drafts carry llama3 RoPE scaling and Kimi drafts YaRN; both reach the draft's tables."""
    spec = DraftSpec()
    config = draft_config(spec)
    config["rope_scaling"] = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    scaled = load(tmp_path / "llama3", spec, target, config=config)
    plain = load(tmp_path / "plain", spec, target)
    assert scaled.rotary._rope_type == "llama3"
    assert scaled.rotary.inv_freq[0] == plain.rotary.inv_freq[0]  # high frequencies are kept
    assert scaled.rotary.inv_freq[-1] < plain.rotary.inv_freq[-1]  # low ones are stretched
    spec = DraftSpec(layout="mla", aux_ids=(0, 1, 2))
    config = draft_config(spec)
    config["rope_scaling"] = {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
    }
    yarn = load(tmp_path / "yarn", spec, deepseek, config=config, method="eagle3.1-mla")
    assert yarn.rotary._rope_type == "yarn" and yarn.rotary.interleaved
    # DeepSeek folds YaRN's all-dimension mscale into the softmax scale: (0.1 ln 4 + 1)^2 / sqrt(12).
    expected = (0.1 * math.log(4.0) + 1) ** 2 / 12**0.5
    assert yarn.midlayer.self_attn.scale == pytest.approx(expected)


def test_pytorch_bin_checkpoint(target, tmp_path):
    """Some EAGLE reference drafts ship pytorch_model.bin instead of safetensors."""
    spec = DraftSpec(layout="eagle", aux_ids=None, draft_vocab=40)
    weights = make_weights(spec)
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(draft_config(spec)))
    torch.save({n: t.float() if t.is_floating_point() else t for n, t in weights.items()}, folder / "pytorch_model.bin")
    draft = load_eagle3_draft(folder, target)
    assert torch.equal(draft.fc.weight, weights["fc.weight"].float().double())
    assert torch.equal(draft.d2t, weights["d2t"])
    (folder / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"cannot read .*pytorch_model\.bin"):
        load_eagle3_draft(folder, target)
