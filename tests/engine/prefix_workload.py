"""Shared by the prefix-caching and chunked-prefill tests: tiny float64 targets with EAGLE3 drafts that
really accept, one config per proposer, and a workload of prompts that share long prefixes.

Targets are nearly bigram (eagle3_oracle.py), so drafts are often right and the accepted paths are
what is checked: speculation is lossless whatever the draft proposes, so equal outputs alone cannot
show a draft pool served stale pages; equal per-request *traces* (drafts, accepted counts) between
prefix caching on and off can. Drafts are written with ``mix`` > 0, so their KV depends on the
hidden state that fed each row, not only on its token.

- ``llama``: 4 layers, as many kv heads as heads (so the unshifted draft can share its last layer's
  KV), 4-token pages; drafts in pools of 3-token pages where a page size can be chosen (pages of the
  two pools meet every 12 tokens).
- ``deepseek``: DeepSeek-V3 (MLA) at 4-token pages; ``eagle3.1-mla`` in its pool, ``eagle3`` (MHA) in
  a pool of its own (16-token pages).
- ``minimax``: MiniMax-M3 on its 128-token pages, ``eagle3`` at 16.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proposers"))
from eagle3_oracle import (  # noqa: E402
    save_deepseek_target,
    save_llama_mha_target,
    save_minimax_m3_target,
    write_oracle_draft,
)
from eagle3_reference import DraftSpec  # noqa: E402

from specdec import LLM, SamplingParams  # noqa: E402

MIX = 0.5
K = 3
BLOCK = {"llama": 4, "deepseek": 4, "minimax": 128}
DRAFT_BLOCK = 3
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
# Every proposer, with the targets it runs on here.
PROPOSERS = {
    "llama": ["none", "ngram", "draft_model", "eagle3", "eagle3-unshifted-sharing", "eagle3-unshifted-own"],
    "deepseek": ["ngram", "eagle3", "eagle3.1-mla"],
    "minimax": ["ngram", "eagle3"],
}
CASES = [(t, p) for t, ps in PROPOSERS.items() for p in ps]
# Pools each proposer caches besides the target's (checked to be really reused).
CACHED_DRAFT_POOLS = {"draft_model", "eagle3", "eagle3-unshifted-own"}




DRAFT_SPECS = {
    ("llama", "eagle3"): DraftSpec(layout="sglang", kv_heads=4, aux_ids=(0, 1, 3), fc_norm=True, norm_output=True),
    ("llama", "unshifted"): DraftSpec(layout="sglang", kv_heads=4, aux_ids=(0, 1, 3)),
    ("deepseek", "eagle3"): DraftSpec(layout="sglang", kv_heads=4, aux_ids=(0, 1, 2), fc_norm=True),
    ("deepseek", "eagle3.1-mla"): DraftSpec(layout="mla", kv_lora_rank=64, aux_ids=(0, 1, 2), fc_norm=True,
                                            norm_output=True, draft_vocab=48),
    ("minimax", "eagle3"): DraftSpec(layout="vllm", kv_heads=4, aux_ids=(0, 1, 2), draft_vocab=48),
}


def build_models(root: Path) -> dict:
    """``{target: folder, (target, draft): folder}``, written once."""
    out = {
        "llama": save_llama_mha_target(root / "llama"),
        "deepseek": save_deepseek_target(root / "deepseek"),
        "minimax": save_minimax_m3_target(root / "minimax"),
    }
    for (target, name), spec in DRAFT_SPECS.items():
        folder = root / f"{target}-{name}"
        write_oracle_draft(folder, spec, out[target], mix=MIX)
        out[target, name] = folder
    return out


def spec_config(models: dict, target: str, proposer: str, k: int = K) -> dict | None:
    if proposer == "none":
        return None
    config: dict = {"num_speculative_tokens": k}
    if proposer == "ngram":
        return {"method": "ngram", **config, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    small_pages = {"block_size": DRAFT_BLOCK} if target != "minimax" else {}
    if proposer == "draft_model":
        # The target as its own draft: always right, so a wrong draft KV would show in the trace.
        return {"method": "draft_model", "model": str(models[target]), **config, **small_pages}
    if proposer == "eagle3":
        extra = small_pages if target == "llama" else {}
        return {"method": "eagle3", "model": str(models[target, "eagle3"]), **config, **extra}
    if proposer == "eagle3.1-mla":
        return {"method": "eagle3.1-mla", "model": str(models[target, "eagle3.1-mla"]), **config}
    if proposer.startswith("eagle3-unshifted"):
        sharing = proposer.endswith("sharing")
        return {"method": "eagle3-unshifted", "model": str(models[target, "unshifted"]), **config,
                "kv_sharing": sharing, **({} if sharing else small_pages)}
    raise ValueError(proposer)


def make_llm(models: dict, target: str, proposer: str, *, caching: bool = True, memory: int = 1 << 23,
             max_num_seqs: int = 3, adaptive: bool = False, **kwargs) -> LLM:
    spec = spec_config(models, target, proposer)
    if adaptive:
        spec["adaptive"] = True
    return LLM(str(models[target]), dtype="float64", block_size=BLOCK[target], kv_cache_memory=memory,
               speculative_config=spec, enable_prefix_caching=caching,
               max_model_len=512 if target == "minimax" else 256, max_num_seqs=max_num_seqs, **kwargs)


# ----------------------------------------------------------------------------- the workload
def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 64) for _ in range(n)]


def rounds(target: str) -> list[list[list[int]]]:
    """The prompts of the generate calls (a third call, turn 2 of a conversation, is added by
    :func:`run_workload` from the first call's outputs).

    Prefixes of several page lengths, shared within a call and with earlier calls: some end on a
    page boundary of the target (16, 128, 256), some on one of both the target's and a 3-token draft
    pool (12, 24), some on neither (13, 26, 33, 250, 270). Prompts in a call are admitted together,
    but ``max_num_seqs`` = 3 holds the fourth back until the first ones have published their pages.
    Some prompts end a few tokens short of a page boundary, so that their growth needs a new page.
    """
    if target == "minimax":
        base = _tokens(300, 0)
        return [
            [base[:120] + _tokens(5, 1), base[:250] + _tokens(2, 2), base[:256] + _tokens(3, 3),
             base[:256] + _tokens(4, 4)],
            [base[:256] + _tokens(4, 5), base[:270] + _tokens(1, 6), base[:128] + _tokens(3, 7)],
        ]
    base = _tokens(40, 0)
    return [
        [base[:26] + _tokens(3, 1), base[:16] + _tokens(2, 2), base[:13] + _tokens(5, 3), base[:26] + _tokens(4, 4)],
        [base[:26] + _tokens(4, 5), base[:33] + _tokens(1, 6), base[:12] + _tokens(3, 7), base[:24]],
    ]


def run_workload(llm: LLM, params=GREEDY, *, on_step=None) -> tuple[list, list]:
    """Run every call of the workload on ``llm``; returns (outputs, traces), one list per call.

    A trace maps each request's input index to its steps' (drafts, accepted, emitted). After every
    call the cache must hold no request, and every page must be free (cached ones count as free)."""
    prompts = rounds(_target_of(llm))
    outputs, traces = [], []

    def call(batch):
        trace: dict[int, list] = {}

        def observe(out):
            for r in out.requests:
                trace.setdefault(r.index, []).append((r.draft_token_ids, r.num_accepted, r.new_token_ids))
            if on_step is not None:
                on_step(out)

        got = llm.generate(batch, params, use_tqdm=False, on_step=observe)
        outputs.append([o.token_ids for o in got])
        traces.append(trace)
        cache = llm.engine.cache
        assert cache.requests() == []
        assert all(cache.num_free_blocks(name) == pool.num_blocks for name, pool in cache.pools.items())

    for batch in prompts:
        call(batch)
    # Turn 2 of two conversations: the turn-1 prompt, its answer, and a new user message.
    first, answers = prompts[0], outputs[0]
    call([first[0] + answers[0] + _tokens(5, 8), first[2] + answers[2] + _tokens(2, 9)])
    return outputs, traces


def _target_of(llm: LLM) -> str:
    return "minimax" if llm.engine.cache.pool("target").block_size == 128 else "llama"


def record_reuse(llm: LLM) -> dict[str, int]:
    """Count, per pool, the cached pages requests start from (wraps the engine's prefix cache)."""
    reused: dict[str, int] = {}
    prefix = llm.engine.prefix
    admit = prefix.admit

    def counting(seq, match):
        if match is not None:
            for name, blocks in match.blocks.items():
                reused[name] = reused.get(name, 0) + len(blocks)
        return admit(seq, match)

    prefix.admit = counting
    return reused


def bytes_per_token(llm: LLM) -> int:
    return sum(p.bytes_per_token() for p in llm.engine.cache.pools.values())
