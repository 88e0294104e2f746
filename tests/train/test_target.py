from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from specdec.backends import get_backend
from specdec.cache import PagedKVCache
from specdec.runtime.model_runner import Chunk, ModelRunner
from specdec.models import load_model
from specdec.train.__main__ import main as train_main
from specdec.train.balance import RouterBalancer
from specdec.train.presets import PRESETS, get_preset
from specdec.train.schedule import cosine_lr
from specdec.train.target import TargetTrainConfig, train_target
from specdec.train.tokenizer import BOS_ID, EOS_ID, PAD_ID, load_tokenizer

TEST_PRESETS = ["test-llama", "test-kimi-k2", "test-minimax-m3"]


def _train(tmp_path, corpus, tokenizer_dir, preset, **kwargs):
    config = TargetTrainConfig(preset=preset, output_dir=str(tmp_path / preset), tokenizer_dir=str(tokenizer_dir),
                               corpus=corpus, progress=False, **kwargs)
    return train_target(config)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_corpus, small_tokenizer_dir):
    """Each test preset trained once for the module: preset -> TrainResult."""
    root = tmp_path_factory.mktemp("targets")
    return {p: _train(root, small_corpus, small_tokenizer_dir, p) for p in TEST_PRESETS}


def _specdec_logits(model, prompt: list[int], block_size: int) -> torch.Tensor:
    """All-position logits of one prompt through specdec's paged prefill."""
    cache = PagedKVCache(1 << 24)
    pools = [cache.register(p) for p in model.kv_pools("target", block_size, torch.float64)]
    cache.build()
    runner = ModelRunner(model, cache, get_backend("torch"), [p.name for p in pools])
    out = runner.forward([Chunk(0, prompt)])
    return model.compute_logits(out.hidden_states)


@pytest.mark.parametrize("preset", TEST_PRESETS)
def test_training_reduces_loss(trained, preset):
    result = trained[preset]
    assert result.steps == get_preset(preset).steps
    uniform = math.log(400)
    assert abs(result.train_losses[0] - uniform) < 0.5  # starts near a uniform guess
    assert sum(result.train_losses[-5:]) / 5 < result.train_losses[0] - 0.5
    assert result.val_losses[-1][1] < uniform - 0.5


@pytest.mark.parametrize("preset", TEST_PRESETS)
def test_checkpoint_loads_in_transformers_and_specdec_with_equal_logits(trained, preset):
    folder = trained[preset].output_dir
    config = json.loads((folder / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)
    assert config["dtype"] == "bfloat16"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    meta = json.loads((folder / "training.json").read_text())
    assert meta["preset"]["name"] == preset and meta["steps"] == trained[preset].steps

    tokenizer = load_tokenizer(folder)
    prompt = tokenizer("def encode(self, o):\n    return")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True, dtype=torch.float64,
                                              experts_implementation="eager")
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), use_cache=False).logits[0]
    ours = load_model(folder, dtype="float64")
    block_size = getattr(ours, "required_block_size", None) or 16
    with torch.no_grad():
        got = _specdec_logits(ours, prompt, block_size)
    assert got.shape == ref.shape
    assert ((got - ref).abs().max() / ref.abs().max()) < 1e-6
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_same_seed_same_weights_other_seed_differs(tmp_path, small_corpus, small_tokenizer_dir):
    def weights(seed, sub):
        result = _train(tmp_path / sub, small_corpus, small_tokenizer_dir, "test-llama", steps=4, seed=seed)
        with safe_open(str(result.output_dir / "model.safetensors"), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    a, b, c = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_router_balancer_moves_bias_towards_idle_experts():
    torch.manual_seed(0)
    model = get_preset("test-kimi-k2").build_model(64)
    balancer = RouterBalancer(model, rate=0.01)
    assert balancer.routers  # one per MoE layer
    router = balancer.routers[0]
    bias = router.e_score_correction_bias
    with torch.no_grad():
        bias[0] = 1.0  # sigmoid scores are below 1, so expert 0 wins every token
        model(input_ids=torch.randint(3, 64, (2, 16)), use_cache=False)
    worst = balancer.step()
    assert worst > 1.0
    assert bias[0] == pytest.approx(0.99)  # overloaded: pushed down
    assert bias.max() == pytest.approx(0.99) and (bias[1:] == 0.01).any()  # idle experts pushed up
    assert balancer.step() == 1.0  # nothing recorded since: no update
    balancer.remove()


def test_cosine_schedule():
    kw = dict(total=100, peak=1.0, warmup=10, min_ratio=0.1)
    assert cosine_lr(0, **kw) == pytest.approx(0.1)
    assert cosine_lr(9, **kw) == pytest.approx(1.0)
    assert cosine_lr(10, **kw) == pytest.approx(1.0)
    assert cosine_lr(55, **kw) == pytest.approx(0.55)
    assert cosine_lr(100, **kw) == pytest.approx(0.1)
    lrs = [cosine_lr(s, **kw) for s in range(10, 101)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))


def test_zoo_presets_have_the_bundled_shapes():
    m3 = get_preset("minimax-m3-tiny").hf_config(4096)
    assert m3.index_block_size == 128 and "minimax_m3_sparse" in m3.layer_types
    assert m3.mlp_layer_types[0] == "dense" and m3.mlp_layer_types[-1] == "sparse"
    # Typical prompts and generations fit in the attended blocks, so sparsity never drops context there.
    assert m3.index_topk_blocks * m3.index_block_size >= 1024
    kimi = get_preset("kimi-k2-tiny").hf_config(4096)
    assert kimi.kv_lora_rank and kimi.first_k_dense_replace == 1 and kimi.num_nextn_predict_layers == 0
    with torch.device("meta"):
        m3_params = sum(p.numel() for p in get_preset("minimax-m3-tiny").build_model(4096).parameters())
        draft_params = sum(p.numel() for p in get_preset("draft-model-tiny").build_model(4096).parameters())
    assert 13e6 < m3_params < 30e6
    assert 0.5e6 < draft_params < 2e6


def test_bad_configs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        TargetTrainConfig(preset="nope", output_dir=str(tmp_path))
    with pytest.raises(ValueError, match="either steps or quick"):
        TargetTrainConfig(preset="test-llama", output_dir=str(tmp_path), steps=3, quick=True)
    with pytest.raises(ValueError, match="vocab_size comes from the tokenizer"):
        PRESETS["test-llama"].__class__(**{**_fields(PRESETS["test-llama"]), "config": {"vocab_size": 9}})


def _fields(preset):
    import attrs

    return {f.name: getattr(preset, f.name) for f in attrs.fields(type(preset))}


def test_cli_lists_presets_and_reports_errors(capsys, tmp_path):
    assert train_main(["presets"]) == 0
    assert "minimax-m3-tiny" in capsys.readouterr().out
    assert train_main(["target", "--preset", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "unknown preset" in err


def test_throughput_measurement_runs_on_a_test_preset():
    from specdec.train.draft import measure_draft_throughput
    from specdec.train.target import measure_throughput

    target = measure_throughput("test-llama", steps=1, vocab_size=256)
    assert target["tokens_per_second"] > 0 and target["best_step_s"] <= target["median_step_s"]
    draft = measure_draft_throughput("test-eagle3", "test-llama", steps=1, vocab_size=256)
    assert draft["tokens_per_second"] > 0 and draft["ttt_steps"] == 3
