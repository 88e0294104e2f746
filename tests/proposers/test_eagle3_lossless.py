"""Greedy EAGLE3 speculation is lossless: token for token the non-speculative output, in float64.

Through ``LLM`` with ragged prompts and k in {1, 3, 5}: a Llama target with each checkpoint
layout (3.1 flags on and off, reduced draft vocabularies), a DeepSeek-V3 (MLA) target with an MLA
draft in its pool (``eagle3.1-mla``) and with an MHA draft in a pool of its own at another page
size, a MiniMax-M3 target on 128-token pages with a 16-token draft pool, and a cache so small that
requests are preempted and recomputed. The drafts are built to be often right (eagle3_oracle.py),
so acceptance is real and the accepted paths are what is being checked.
"""

from __future__ import annotations

import pytest
from eagle3_oracle import save_deepseek_target, save_llama_target, save_minimax_m3_target, write_oracle_draft
from eagle3_reference import DraftSpec

from specdec import LLM, SamplingParams

PROMPTS = [
    [3, 17, 5, 9, 41, 2, 33, 8, 12],
    [7, 1, 60, 22, 22, 5, 14],
    [4],
    [10, 20, 30, 40, 50, 60, 11, 21, 31, 41, 51, 61, 12],
    [9, 9],
]
MAX_TOKENS = 22  # not a multiple of k + 1: the last steps get fewer drafts
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
MEMORY = 1 << 23


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_lossless")
    return {
        "llama": save_llama_target(root / "llama"),
        "deepseek": save_deepseek_target(root / "deepseek"),
        "minimax_m3": save_minimax_m3_target(root / "minimax_m3"),
    }


@pytest.fixture(scope="module")
def baseline(folders):
    """Non-speculative greedy outputs per (target, block_size), computed once."""
    done: dict = {}

    def get(target: str, block_size: int | None, prompts=PROMPTS):
        key = (target, block_size, len(prompts))
        if key not in done:
            llm = LLM(str(folders[target]), dtype="float64", block_size=block_size, kv_cache_memory=MEMORY)
            done[key] = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        return done[key]

    return get


@pytest.fixture(scope="module")
def drafts(folders, tmp_path_factory):
    """Draft folders by case name, written on first use."""
    root = tmp_path_factory.mktemp("eagle3_drafts")
    written: dict = {}

    def get(case: str):
        if case not in written:
            target, spec = CASES[case]
            write_oracle_draft(root / case, spec, folders[target])
            written[case] = root / case
        return written[case]

    return get


def run(folders, target, draft, k, *, method="eagle3", target_block=None, memory=MEMORY, prompts=PROMPTS, **extra):
    """Generate with speculation; ``extra`` are speculative config keys (``block_size``: the draft's)."""
    config = {"method": method, "model": str(draft), "num_speculative_tokens": k, **extra}
    llm = LLM(str(folders[target]), dtype="float64", block_size=target_block, kv_cache_memory=memory,
              speculative_config=config)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return llm, [o.token_ids for o in outputs]


def check_accepting(llm, k) -> None:
    stats = llm.spec_stats()
    assert len(stats.accepted_per_position) == k
    assert stats.num_accepted_tokens > 0, "nothing accepted: the check would be vacuous"
    cache = llm.engine.cache
    assert cache.requests() == []
    assert all(cache.num_free_blocks(name) == pool.num_blocks for name, pool in cache.pools.items())


CASES = {
    # Llama target, each checkpoint layout; flags and vocabularies spread over them.
    "eagle": ("llama", DraftSpec(layout="eagle", kv_heads=4, aux_ids=None, draft_vocab=40)),
    "sglang-3.1": ("llama", DraftSpec(layout="sglang", kv_heads=4, fc_norm=True, norm_output=True, own_lm_head=False)),
    "sglang_model-3.1-in-eagle_config-reduced": (
        "llama",
        DraftSpec(layout="sglang_model", kv_heads=4, fc_norm=True, norm_output=True, flags_in_eagle_config=True,
                  draft_vocab=48),
    ),
    "vllm-fc_norm": ("llama", DraftSpec(layout="vllm", kv_heads=4, fc_norm=True)),
    "vllm_model-norm_output-reduced": (
        "llama", DraftSpec(layout="vllm_model", kv_heads=4, norm_output=True, draft_vocab=40, own_embed=True)
    ),
    # DeepSeek-V3 target: MLA draft (3.1) in its pool, and an MHA draft in its own.
    "mla-3.1": (
        "deepseek",
        DraftSpec(layout="mla", kv_lora_rank=64, aux_ids=(0, 1, 2), fc_norm=True, norm_output=True, draft_vocab=48),
    ),
    "mla-3.0": ("deepseek", DraftSpec(layout="mla", kv_lora_rank=64, aux_ids=(0, 1, 2), own_lm_head=False)),
    "deepseek-mha": ("deepseek", DraftSpec(layout="sglang", kv_heads=4, aux_ids=(0, 1, 2), fc_norm=True)),
    # MiniMax-M3 target: its published draft is Llama-style with layers.0.* keys.
    "minimax_m3": ("minimax_m3", DraftSpec(layout="vllm", kv_heads=4, aux_ids=(0, 1, 2), draft_vocab=48)),
}
LLAMA_CASES = [c for c, (t, _) in CASES.items() if t == "llama"]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("case", LLAMA_CASES)
def test_llama_target_every_layout(case, k, folders, baseline, drafts):
    # Draft pages of 3 against the target's 4: the pools keep their own page sizes.
    llm, outputs = run(folders, "llama", drafts(case), k, target_block=4, **({"block_size": 3} if k == 3 else {}))
    assert outputs == baseline("llama", 4)
    check_accepting(llm, k)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("case", ["mla-3.1", "mla-3.0"])
def test_deepseek_target_mla_draft_in_its_pool(case, k, folders, baseline, drafts):
    block = {1: 1, 3: 64, 5: 4}[k]  # page sizes of the MLA kernels (1, 64) and a small one
    llm, outputs = run(folders, "deepseek", drafts(case), k, method="eagle3.1-mla", target_block=block)
    assert outputs == baseline("deepseek", block)
    assert list(llm.engine.cache.pools) == ["target"]
    check_accepting(llm, k)


@pytest.mark.parametrize("target_block", [1, 64])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_deepseek_target_mha_draft_own_page_size(target_block, k, folders, baseline, drafts):
    llm, outputs = run(folders, "deepseek", drafts("deepseek-mha"), k, target_block=target_block)
    assert outputs == baseline("deepseek", target_block)
    cache = llm.engine.cache
    assert (cache.pool("target").block_size, cache.pool("draft").block_size) == (target_block, 16)
    check_accepting(llm, k)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_minimax_m3_target_on_128_token_pages(k, folders, baseline, drafts):
    # One prompt crosses a 128-token target page (and many 16-token draft pages).
    prompts = PROMPTS[:3] + [[(7 * i + 3) % 64 for i in range(140)]]
    llm, outputs = run(folders, "minimax_m3", drafts("minimax_m3"), k, prompts=prompts)
    assert outputs == baseline("minimax_m3", None, prompts)
    cache = llm.engine.cache
    assert cache.pool("target").block_size == 128 and cache.pool("draft").block_size == 16
    check_accepting(llm, k)


@pytest.mark.parametrize("case", ["sglang-3.1", "mla-3.1"])
def test_lossless_under_preemption(case, folders, baseline, drafts):
    target = CASES[case][0]
    k, block = 3, 4
    method = "eagle3.1-mla" if case.startswith("mla") else "eagle3"
    roomy, _ = run(folders, target, drafts(case), k, method=method, target_block=block)
    per_token = sum(p.bytes_per_token() for p in roomy.engine.cache.pools.values())
    # About two requests' worth of pages for five requests.
    budget = per_token * 2 * (max(map(len, PROMPTS)) + MAX_TOKENS + k + 2 * block)
    llm, outputs = run(folders, target, drafts(case), k, method=method, target_block=block, memory=budget)
    assert llm.engine.stats.num_preemptions > 0
    assert outputs == baseline(target, block)
    check_accepting(llm, k)


def test_drafts_respect_max_model_len(folders, drafts):
    """Near max_model_len the engine offers fewer drafts; the proposer never drafts past them."""
    folder = str(folders["llama"])
    prompts = [PROMPTS[0], PROMPTS[3]]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(folder, dtype="float64", max_model_len=30, kv_cache_memory=MEMORY)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    config = {"method": "eagle3", "model": str(drafts("sglang-3.1")), "num_speculative_tokens": 5}
    llm = LLM(folder, dtype="float64", max_model_len=30, kv_cache_memory=MEMORY, speculative_config=config)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and [len(p) + len(g) for p, g in zip(prompts, got)] == [30, 30]
