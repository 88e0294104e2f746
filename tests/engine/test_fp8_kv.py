"""``kv_cache_dtype="fp8"`` through the engine, in float64 so rounding cannot hide a bug.

- Greedy outputs with fp8 pages equal those of a reference whose float64 pages hold the same values
  rounded to fp8 and back (llama MHA, Kimi-K2's MLA latent, MiniMax-M3's block-sparse attention and
  indexer keys).
- Speculative greedy output with fp8 KV equals plain greedy output with fp8 KV, for every proposer
  (the draft's pools store fp8 too).
- The budget counts bytes per pool (fp8 pages hold twice bf16's tokens); the checkpoint's ``k_scale``
  / ``v_scale`` reach the pools; a backend that cannot read fp8 pages is refused in one line.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specdec import LLM, SamplingParams
from specdec.backends import BACKENDS, register_backend
from specdec.backends.torch_ref import TorchBackend
from specdec.cache.pool import PagedPool
from specdec.cache.quant import round_trip
from specdec.engine.compat import KVDtypeError
from specdec.zoo import zoo_path

PROMPTS = [[11, 12, 13, 14, 15, 16, 11, 12, 13], [200, 201, 202], [7] * 12, [300, 301, 302, 303, 304]]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
TARGETS = {"llama": "llama-tiny", "kimi": "kimi-k2-tiny", "minimax": "minimax-m3-tiny"}
PROPOSERS = {
    "llama": {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        "draft_model": {"method": "draft_model", "model": "draft-model-tiny", "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": "llama-tiny-eagle3", "num_speculative_tokens": 3},
        "eagle3-unshifted": {"method": "eagle3-unshifted", "model": "llama-tiny-eagle3-unshifted",
                             "num_speculative_tokens": 3},
    },
    "kimi": {
        "eagle3": {"method": "eagle3", "model": "kimi-k2-tiny-eagle3", "num_speculative_tokens": 3},
        "eagle3.1-mla": {"method": "eagle3.1-mla", "model": "kimi-k2-tiny-eagle3.1-mla", "num_speculative_tokens": 3},
    },
    "minimax": {"eagle3": {"method": "eagle3", "model": "minimax-m3-tiny-eagle3", "num_speculative_tokens": 3}},
}


def _llm(target: str, spec: dict | None = None, **kwargs) -> LLM:
    if spec is not None and "model" in spec:
        spec = {**spec, "model": str(zoo_path(spec["model"]))}
    kwargs.setdefault("kv_cache_memory", 1 << 22)
    return LLM(str(zoo_path(TARGETS[target])), dtype="float64", speculative_config=spec, **kwargs)


def _outputs(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def fp8_plain():
    return {target: _outputs(_llm(target, kv_cache_dtype="fp8")) for target in TARGETS}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fp8_pages_read_back_the_rounded_kv(target, fp8_plain, monkeypatch):
    encode = PagedPool.encode

    def rounding(pool, layer, values):  # float64 pages holding what fp8 pages hold
        return {key: round_trip(value, 1.0, torch.float8_e4m3fn) for key, value in encode(pool, layer, values).items()}

    monkeypatch.setattr(PagedPool, "encode", rounding)
    assert _outputs(_llm(target)) == fp8_plain[target]


def test_the_rounding_matters(fp8_plain):
    """Without it (float64 pages) some target emits other tokens: the equality above is not vacuous."""
    assert any(_outputs(_llm(target)) != fp8_plain[target] for target in TARGETS)


@pytest.mark.parametrize("target,proposer", [(t, p) for t in sorted(PROPOSERS) for p in sorted(PROPOSERS[t])])
def test_speculative_output_with_fp8_kv_equals_plain_output_with_fp8_kv(target, proposer, fp8_plain):
    llm = _llm(target, PROPOSERS[target][proposer], kv_cache_dtype="fp8")
    assert all(p.quantized for p in llm.engine.cache.pools.values())
    assert _outputs(llm) == fp8_plain[target]
    assert llm.spec_stats().num_drafts > 0


def test_budget_counts_bytes_per_pool():
    budget = 1 << 21
    bf16 = LLM(str(zoo_path("llama-tiny")), dtype="bfloat16", kv_cache_memory=budget).engine.cache.pools["target"]
    fp8 = LLM(str(zoo_path("llama-tiny")), dtype="bfloat16", kv_cache_memory=budget,
              kv_cache_dtype="fp8_e5m2").engine.cache.pools["target"]
    assert fp8.dtype == torch.float8_e5m2 and fp8.bytes_per_token() * 2 == bf16.bytes_per_token()
    assert fp8.num_blocks == 2 * bf16.num_blocks
    spec = {"method": "eagle3", "model": str(zoo_path("llama-tiny-eagle3")), "num_speculative_tokens": 2}
    mixed = LLM(str(zoo_path("llama-tiny")), dtype="bfloat16", kv_cache_memory=budget, kv_cache_dtype="fp8",
                draft_kv_cache_dtype="auto", speculative_config=spec).engine.cache.pools
    assert mixed["target"].dtype == torch.float8_e4m3fn and mixed["draft"].dtype == torch.bfloat16


def test_checkpoint_kv_scales_reach_the_pools(tmp_path):
    folder = tmp_path / "scaled"
    shutil.copytree(zoo_path("llama-tiny"), folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.1.self_attn.k_scale"] = torch.tensor(0.5)
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor(2.0)
    save_file(weights, folder / "model.safetensors")
    pool = LLM(str(folder), dtype="float32", kv_cache_memory=1 << 21, kv_cache_dtype="fp8").engine.cache.pools["target"]
    assert (pool.scale(1, "k"), pool.scale(1, "v"), pool.scale(0, "k")) == (0.5, 2.0, 1.0)
    plain = LLM(str(folder), dtype="float32", kv_cache_memory=1 << 21).engine.cache.pools["target"]
    assert plain.scale(1, "k") is None  # pools of the model's dtype take no scales


class NoFp8Backend(TorchBackend):
    name = "torch-no-fp8"

    def supports_kv_dtype(self, dtype, pool_kind):
        return dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def test_a_backend_that_cannot_read_fp8_pages_is_refused_in_one_line():
    register_backend(NoFp8Backend.name, NoFp8Backend)
    try:
        with pytest.raises(KVDtypeError) as caught:
            LLM(str(zoo_path("llama-tiny")), kv_cache_memory=1 << 21, kv_cache_dtype="fp8",
                attention_backend=NoFp8Backend.name)
        message = str(caught.value)
        assert "\n" not in message and "float8_e4m3fn" in message and "kv_cache_dtype" in message
    finally:
        BACKENDS.unregister(NoFp8Backend.name)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(zoo_path("llama-tiny")), kv_cache_dtype="int4")
