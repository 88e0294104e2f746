"""llama / qwen2 / qwen3 / mistral over the paged cache versus transformers, in float64."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from paged_reference import assert_traces_match, specdec_greedy, transformers_greedy
from specdec.backends import get_backend
from specdec.cache import AttentionPool, PagedKVCache
from specdec.runtime.model_runner import Chunk, ModelRunner
from specdec.models import load_model
from specdec.models.llama import LlamaForCausalLM, sliding_windows

NUM_LAYERS = 3
# Ragged prompts longer than the sliding windows below and spanning several pages.
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11],
    [5, 6, 7],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
]
STEPS = 20
AUX_IDS = (0, 1, NUM_LAYERS - 1)

_BASE = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=NUM_LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # Wider than transformers' 0.02 so greedy tokens vary and RoPE / masking errors show.
    initializer_range=0.1,
)

# name -> (config overrides, page size, expected per-layer sliding windows)
VARIANTS = {
    # head_dim set apart from hidden/heads, llama3 RoPE scaling in range of the prompts, all biases.
    "llama3-bias": (
        dict(
            model_type="llama",
            head_dim=16,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        4,
        [None] * NUM_LAYERS,
    ),
    "llama-tied-linear-gelu": (
        dict(
            model_type="llama",
            tie_word_embeddings=True,
            hidden_act="gelu_pytorch_tanh",
            rope_parameters=dict(rope_type="linear", rope_theta=500.0, factor=2.0),
        ),
        5,
        [None] * NUM_LAYERS,
    ),
    # qkv bias; sliding window on the layers from max_window_layers on; YaRN.
    "qwen2-sliding-yarn": (
        dict(
            model_type="qwen2",
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16),
        ),
        4,
        [None, 6, 6],
    ),
    "qwen3-tied-qknorm": (
        dict(model_type="qwen3", head_dim=16, tie_word_embeddings=True),
        8,
        [None] * NUM_LAYERS,
    ),
    "mistral-sliding": (
        dict(model_type="mistral", sliding_window=5, head_dim=8),
        4,
        [5] * NUM_LAYERS,
    ),
}


def build_checkpoint(tmp_path_factory, name: str, overrides: dict):
    overrides = dict(overrides)
    model_type = overrides.pop("model_type")
    config = AutoConfig.for_model(model_type, **{**_BASE, **overrides})
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    folder = tmp_path_factory.mktemp(name)
    hf_model.save_pretrained(folder, safe_serialization=True)
    return folder, hf_model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    overrides, block_size, windows = VARIANTS[request.param]
    folder, hf_model = build_checkpoint(tmp_path_factory, request.param, overrides)
    return request.param, folder, hf_model, block_size, windows


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A plain untied llama checkpoint for the single-variant tests."""
    return build_checkpoint(tmp_path_factory, "llama", VARIANTS["llama3-bias"][0])


def test_matches_transformers_prefill_and_decode(variant):
    name, folder, hf_model, block_size, windows = variant
    ours = load_model(folder, dtype="float64")
    assert isinstance(ours, LlamaForCausalLM)
    # The window must really be in force, or the sliding variants would prove nothing.
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == windows
    trace = specdec_greedy(ours, PROMPTS, STEPS, block_size=block_size, aux_layer_ids=AUX_IDS)
    ref = transformers_greedy(hf_model, PROMPTS, STEPS, aux_layer_ids=AUX_IDS)
    assert_traces_match(trace, ref)
    assert all(len(aux) == len(p) for aux, p in zip(trace.prefill_aux, PROMPTS))


def test_tied_embeddings_share_the_embedding_matrix(tmp_path_factory):
    folder, _ = build_checkpoint(tmp_path_factory, "tied", VARIANTS["qwen3-tied-qknorm"][0])
    ours = load_model(folder, dtype="float64")
    assert ours.lm_head is None
    hidden = torch.randn(3, 32, dtype=torch.float64)
    assert torch.equal(ours.compute_logits(hidden), hidden @ ours.model.embed_tokens.weight.T)


def _run_prefill(model, prompts, aux_layer_ids, block_size=4):
    cache = PagedKVCache(1 << 22)
    pools = [cache.register(p) for p in model.kv_pools("target", block_size, torch.float64)]
    cache.build()
    runner = ModelRunner(model, cache, get_backend("torch"), [p.name for p in pools])
    return runner.forward([Chunk(i, p) for i, p in enumerate(prompts)], aux_layer_ids)


def test_aux_hidden_states_follow_capture_before_convention(llama):
    folder, hf_model = llama
    ours = load_model(folder, dtype="float64")
    ids = (0, 1, NUM_LAYERS - 1)
    out = _run_prefill(ours, PROMPTS[:2], ids)
    flat = torch.tensor([t for p in PROMPTS[:2] for t in p])
    hidden = ours.model.embed_tokens.weight.shape[1]
    assert out.aux_hidden_states.shape == (len(flat), len(ids) * hidden)
    # id 0 is exactly the embeddings.
    assert torch.equal(out.aux_hidden_states[:, :hidden], ours.embed(flat))
    with torch.no_grad():
        ref = [hf_model(torch.tensor([p]), output_hidden_states=True).hidden_states for p in PROMPTS[:2]]
    for chunk, layer in enumerate(ids):
        mine = out.aux_hidden_states[:, chunk * hidden : (chunk + 1) * hidden]
        theirs = torch.cat([states[layer][0] for states in ref])
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    # The pre-norm output of the last layer, normed, is the hidden state the LM head reads.
    torch.testing.assert_close(ours.model.norm(out.prenorm_hidden_states), out.hidden_states, rtol=0, atol=0)


def test_aux_ids_are_concatenated_in_ascending_order(llama):
    folder, _ = llama
    ours = load_model(folder, dtype="float64")
    a = _run_prefill(ours, PROMPTS[:1], (2, 0)).aux_hidden_states
    b = _run_prefill(ours, PROMPTS[:1], (0, 2)).aux_hidden_states
    assert torch.equal(a, b)
    # Colliding ids (EAGLE3's defaults on tiny targets) keep one chunk per requested id.
    c = _run_prefill(ours, PROMPTS[:1], (1, 1)).aux_hidden_states
    assert c.shape[1] == 2 * 32 and torch.equal(c[:, :32], c[:, 32:])


@pytest.mark.parametrize("bad", [NUM_LAYERS, -1])
def test_aux_id_out_of_range_is_rejected(llama, bad):
    folder, _ = llama
    ours = load_model(folder, dtype="float64")
    with pytest.raises(ValueError, match=rf"aux layer id {bad} is out of range.*0\.\.{NUM_LAYERS - 1}"):
        _run_prefill(ours, PROMPTS[:1], (0, bad))


def test_kv_pools_describe_one_attention_pool(llama):
    folder, _ = llama
    ours = load_model(folder, dtype="float64")
    (pool,) = ours.kv_pools("tgt", 16, torch.float64)
    assert isinstance(pool, AttentionPool) and pool.name == "tgt"
    assert (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.block_size) == (NUM_LAYERS, 2, 16, 16)
    assert all(layer.self_attn.pool == "tgt" for layer in ours.model.layers)
    assert ours.required_block_size is None
    assert (ours.num_layers, ours.hidden_size, ours.vocab_size) == (NUM_LAYERS, 32, 97)


def test_forward_before_kv_pools_says_what_to_do(llama):
    folder, _ = llama
    ours = load_model(folder, dtype="float64")
    with pytest.raises(RuntimeError, match="call kv_pools"):
        ours.forward(torch.tensor([1, 2]), torch.tensor([0, 1]), ctx=None)


def test_bfloat16_loads_and_runs(llama):
    folder, _ = llama
    ours = load_model(folder, dtype="bfloat16")
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    trace = specdec_greedy(ours, PROMPTS, 3, block_size=4)
    ref = specdec_greedy(load_model(folder, dtype="float64"), PROMPTS, 3, block_size=4)
    for low, high in zip(trace.logits, ref.logits):
        first_low, first_high = low[0].double(), high[0]
        assert low[0].dtype == torch.bfloat16 and torch.isfinite(first_low).all()
        # bf16 keeps ~3 significant digits: the first-step logits must agree to that, not more.
        assert torch.nn.functional.cosine_similarity(first_low, first_high, dim=0) > 0.999


def test_sliding_windows_per_architecture():
    mistral = AutoConfig.for_model("mistral", num_hidden_layers=3, sliding_window=7)
    assert sliding_windows(mistral) == [7, 7, 7]
    assert sliding_windows(AutoConfig.for_model("mistral", num_hidden_layers=2, sliding_window=None)) == [None, None]
    qwen2 = AutoConfig.for_model("qwen2", num_hidden_layers=4, use_sliding_window=True, sliding_window=9, max_window_layers=2)
    assert sliding_windows(qwen2) == [None, None, 9, 9]
    # Qwen's sliding window is off unless use_sliding_window says so.
    assert sliding_windows(AutoConfig.for_model("qwen3", num_hidden_layers=2, sliding_window=9)) == [None, None]
    assert sliding_windows(AutoConfig.for_model("llama", num_hidden_layers=2)) == [None, None]
    odd = AutoConfig.for_model("qwen3", num_hidden_layers=2, use_sliding_window=True, sliding_window=9)
    odd.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="unsupported layer_types.*chunked_attention"):
        sliding_windows(odd)
