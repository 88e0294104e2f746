"""Checkpoint loading: errors that name the problem, sharded files, dtype, older hub spellings."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM as HFLlama

from paged_reference import assert_traces_match, specdec_greedy, transformers_greedy
from specdec.models import CheckpointError, load_model, supported_model_types
from specdec.models.loader import resolve_dtype

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7]]


def tiny_config(**overrides) -> LlamaConfig:
    base = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
    )
    return LlamaConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A float64 llama checkpoint saved by transformers, and the transformers model itself."""
    torch.manual_seed(0)
    hf_model = HFLlama(tiny_config()).to(torch.float64).eval()
    folder = tmp_path_factory.mktemp("llama")
    hf_model.save_pretrained(folder, safe_serialization=True)
    return folder, hf_model


def copy_with_tensors(src, dst, edit):
    """Copy checkpoint ``src`` to ``dst`` with its tensors dict passed through ``edit``."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def edit_config(folder, edit):
    raw = json.loads((folder / "config.json").read_text())
    edit(raw)
    (folder / "config.json").write_text(json.dumps(raw))


# ----- not a checkpoint -----
def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_folder_without_config(checkpoint, tmp_path):
    shutil.copy(checkpoint[0] / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="not a checkpoint folder: it has no config.json"):
        load_model(tmp_path)


def test_config_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{model_type: llama")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(tmp_path)


def test_folder_without_weights(checkpoint, tmp_path):
    shutil.copy(checkpoint[0] / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"holds no \*\.safetensors weights"):
        load_model(tmp_path)


@pytest.mark.parametrize("model_type", ["gpt2", "no_such_architecture", None])
def test_unknown_model_type_lists_supported_ones(checkpoint, tmp_path, model_type):
    folder = shutil.copytree(checkpoint[0], tmp_path / "ckpt")
    edit_config(folder, lambda raw: raw.update(model_type=model_type) if model_type else raw.pop("model_type"))
    with pytest.raises(CheckpointError, match=rf"unsupported model_type {model_type!r}; supported: ") as err:
        load_model(folder)
    for supported in supported_model_types():
        assert supported in str(err.value)


# ----- tensors that do not fit -----
def test_missing_tensor_is_named(checkpoint, tmp_path):
    folder = copy_with_tensors(checkpoint[0], tmp_path / "ckpt", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: .*\(1 of 2 pieces\): model\.layers\.1\.mlp\.up_proj\.weight$"):
        load_model(folder)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    def add(tensors):
        tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4, 4, dtype=torch.float64)

    folder = copy_with_tensors(checkpoint[0], tmp_path / "ckpt", add)
    with pytest.raises(CheckpointError, match=r"unexpected tensors in the checkpoint: model\.layers\.0\.self_attn\.extra_proj"):
        load_model(folder)


def test_shape_mismatch_is_named(checkpoint, tmp_path):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(4, 16, dtype=torch.float64)

    folder = copy_with_tensors(checkpoint[0], tmp_path / "ckpt", shrink)
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(4, 16\), the model expects \(8, 16\)"
    ):
        load_model(folder)


# ----- layouts and spellings that must load -----
def test_sharded_checkpoint_loads_like_a_single_file(checkpoint, tmp_path):
    folder, hf_model = checkpoint
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="8KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    sharded, single = load_model(tmp_path, dtype="float64"), load_model(folder, dtype="float64")
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        assert torch.equal(a, b), name
    assert_traces_match(specdec_greedy(sharded, PROMPTS, 5, block_size=4), transformers_greedy(hf_model, PROMPTS, 5))


def test_sharded_checkpoint_with_a_missing_shard(checkpoint, tmp_path):
    checkpoint[1].save_pretrained(tmp_path, safe_serialization=True, max_shard_size="8KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"shards listed in model\.safetensors\.index\.json are missing: \['{shard.name}'\]"):
        load_model(tmp_path)


def test_dtype_auto_takes_the_checkpoints_dtype(checkpoint, tmp_path):
    torch.manual_seed(2)
    HFLlama(tiny_config()).to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert {p.dtype for p in load_model(tmp_path, dtype="auto").parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load_model(tmp_path, dtype="float32").parameters()} == {torch.float32}
    assert {p.dtype for p in load_model(checkpoint[0]).parameters()} == {torch.float64}


def test_dtype_auto_without_a_recorded_dtype_is_float32(checkpoint, tmp_path):
    folder = shutil.copytree(checkpoint[0], tmp_path / "ckpt")

    def forget_dtype(raw):
        raw.pop("dtype", None)
        raw.pop("torch_dtype", None)

    edit_config(folder, forget_dtype)
    assert {p.dtype for p in load_model(folder).parameters()} == {torch.float32}


def test_unknown_dtype_lists_choices():
    with pytest.raises(ValueError, match=r"unknown dtype 'float8'; choose one of \['auto', 'float32'"):
        resolve_dtype("float8", tiny_config())


def test_legacy_rope_spelling_loads_and_is_applied(checkpoint, tmp_path):
    """An older config.json with ``rope_theta`` / ``rope_scaling`` instead of ``rope_parameters``."""
    folder = shutil.copytree(checkpoint[0], tmp_path / "legacy")

    def legacy(raw):
        raw.pop("rope_parameters")
        raw["rope_theta"] = 500.0
        raw["rope_scaling"] = {"type": "linear", "factor": 4.0}

    edit_config(folder, legacy)
    ours = load_model(folder, dtype="float64")
    rotary = ours.model.rotary_emb
    # Linear scaling divides the default frequencies by the factor: the legacy keys took effect.
    default = 1.0 / (500.0 ** (torch.arange(0, 4, 2).float() / 4))
    torch.testing.assert_close(rotary.inv_freq, default / 4.0)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    assert_traces_match(specdec_greedy(ours, PROMPTS, 8, block_size=4), transformers_greedy(hf_model, PROMPTS, 8))


def test_hub_extras_are_skipped(checkpoint, tmp_path):
    """Old checkpoints carry RoPE tables; tied ones may still store ``lm_head.weight``."""
    torch.manual_seed(1)
    tied = HFLlama(tiny_config(tie_word_embeddings=True)).to(torch.float64).eval()
    tied.save_pretrained(tmp_path / "tied", safe_serialization=True)

    def extras(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)
        tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])

    folder = copy_with_tensors(tmp_path / "tied", tmp_path / "extras", extras)
    ours = load_model(folder, dtype="float64")
    assert_traces_match(specdec_greedy(ours, PROMPTS, 5, block_size=4), transformers_greedy(tied, PROMPTS, 5))


def test_base_model_checkpoint_without_model_prefix(checkpoint, tmp_path):
    folder, hf_model = checkpoint

    def strip(tensors):
        for name in [n for n in tensors if n.startswith("model.")]:
            tensors[name[len("model.") :]] = tensors.pop(name)

    ours = load_model(copy_with_tensors(folder, tmp_path / "bare", strip), dtype="float64")
    assert_traces_match(specdec_greedy(ours, PROMPTS, 5, block_size=4), transformers_greedy(hf_model, PROMPTS, 5))
