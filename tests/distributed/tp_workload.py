"""Shared by the tensor-parallel tests: the zoo pairs, one config per proposer, a ragged workload that
preempts under a tight per-rank KV budget, and a context manager for a tensor-parallel ``LLM``.

Every scenario runs the same two ``generate`` calls (greedy with logprobs on one request; seeded
sampling with per-request seeds, temperatures, top-p / top-k and one greedy request in the batch), so
one tensor-parallel ``LLM`` (one spawn, the expensive part) answers both.

The per-rank KV budget is ``TIGHT_TOKENS[target]`` tokens at one rank's bytes per token. A rank of two
holds half the KV heads where they split (llama, MiniMax-M3) and all of MLA's latent (DeepSeek-V3),
so those bytes hold 1x to 2x as many tokens on a rank; the budgets are chosen so that both ends fit
the longest request and stay well below what the requests need together (the tests assert that
requests were preempted). The one-rank reference then gets the capacity the two-rank run had.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from specdec import LLM, SamplingParams
from specdec.distributed import parallel_state as ps
from specdec.zoo import zoo_path

K = 3
MAX_TOKENS = 12
DTYPE = "float64"
ROOMY = 64 << 20  # one-rank references without pressure: nothing preempted (asserted)

TARGETS = {"llama": "llama-tiny", "kimi": "kimi-k2-tiny", "minimax": "minimax-m3-tiny"}
# Prompt lengths: ragged, straddling page boundaries (16-token pages; MiniMax-M3's are 128 tokens,
# so its long prompts cross into a second page while decoding).
LENGTHS = {
    "llama": [9, 23, 31, 14, 40],
    "kimi": [9, 23, 31, 14, 40],
    "minimax": [118, 123, 41, 126, 9],
}
# The per-rank budget, in tokens of the one-rank layout (see the module docstring):
# llama: 4 pages of 16, kimi 6, against 14 pages of demand; MiniMax-M3: 2 pages of 128 against 8.
TIGHT_TOKENS = {"llama": 64, "kimi": 96, "minimax": 256}

# (target, proposer): every proposer that applies to each target. draft_model needs the target's
# vocabulary (draft-model-tiny is llama-tiny's), eagle3-unshifted has a llama draft, eagle3.1-mla an
# MLA draft for kimi. An EAGLE3 layer runs whole on every rank by default; "eagle3-sharded" splits it
# over the ranks (draft_tensor_parallel_size=2), and the unshifted draft, which reads the target's
# KV heads (kv_sharing, its default), is split like the target. "eagle3-int4" quantizes the draft
# (quantization=int4): the whole layer alike on every rank, the LM head's rows by vocabulary shard.
SCENARIOS = [
    ("llama", "none"),
    ("llama", "ngram"),
    ("llama", "draft_model"),
    ("llama", "eagle3"),
    ("llama", "eagle3-int4"),
    ("llama", "eagle3-unshifted"),
    ("kimi", "none"),
    ("kimi", "ngram"),
    ("kimi", "eagle3-sharded"),
    ("kimi", "eagle3.1-mla"),
    ("minimax", "none"),
    ("minimax", "ngram"),
    ("minimax", "eagle3"),
]
MODEL_DRAFTS = {"draft_model", "eagle3", "eagle3-int4", "eagle3-sharded", "eagle3-unshifted", "eagle3.1-mla"}
# Drafts whole on every rank: a greedy draft step exchanges only a (max, id) pair per row and rank.
WHOLE_DRAFTS = {"eagle3", "eagle3-int4", "eagle3.1-mla"}


def spec_config(target: str, proposer: str, size: int = 2) -> str | None:
    """The speculative config string of ``proposer`` on ``target`` at ``size`` ranks (None for "none").
    One rank runs a "-sharded" draft whole: the same draft."""
    if proposer == "none":
        return None
    common = f"num_speculative_tokens={K}"
    if proposer == "ngram":
        return f"ngram:{common},prompt_lookup_min=1,prompt_lookup_max=3"
    if proposer == "draft_model":
        return f"draft_model:model={zoo_path('draft-model-tiny')},{common}"
    method = proposer.removesuffix("-sharded").removesuffix("-int4")
    config = f"{method}:model={zoo_path(f'{TARGETS[target]}-{method}')},{common}"
    if proposer.endswith("-sharded") and size > 1:
        config += f",draft_tensor_parallel_size={size}"
    if proposer.endswith("-int4"):
        config += ",quantization=int4"
    return config


def prompts(windows: list[list[int]], target: str) -> list[list[int]]:
    """The workload's prompts for ``target``: held-out corpus windows cut to ``LENGTHS[target]``."""
    return [window[:n] for window, n in zip(windows, LENGTHS[target])]


GREEDY = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)] + \
         [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)] * 4
SAMPLED = [
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=11),
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, top_p=0.9, seed=12),
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),  # a greedy request in a sampling batch
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.7, top_k=20, seed=14),
    SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.2, seed=15),
]


def make_llm(target: str, proposer: str, *, kv_cache_memory: int = ROOMY, tensor_parallel_size: int = 1) -> LLM:
    return LLM(str(zoo_path(TARGETS[target])), speculative_config=spec_config(target, proposer, tensor_parallel_size),
               dtype=DTYPE, kv_cache_memory=kv_cache_memory, tensor_parallel_size=tensor_parallel_size)


def bytes_per_token(llm: LLM) -> int:
    """KV bytes per token over every pool of ``llm``'s cache (one rank's)."""
    return sum(p.bytes_per_token() for p in llm.engine.cache.pools.values())


@contextlib.contextmanager
def tensor_parallel_llm(target: str, proposer: str, *, kv_cache_memory: int, size: int = 2) -> Iterator[LLM]:
    """A ``size``-rank ``LLM`` (this process is the driver), closed on the way out."""
    llm = make_llm(target, proposer, kv_cache_memory=kv_cache_memory, tensor_parallel_size=size)
    try:
        yield llm
    finally:
        llm.close()


def run(llm: LLM, batch: list[list[int]]) -> dict:
    """The workload's two calls on ``llm``: greedy and seeded sampled token ids, the greedy call's
    logprobs, what the engine did (steps, preemptions, speculation counters), and the bytes and
    collectives this process sent per call and phase (empty with one rank)."""
    out: dict = {"sent": {}}
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        ps.counter.reset()
        outputs = llm.generate(batch, params, use_tqdm=False)
        out[name] = [o.token_ids for o in outputs]
        out["sent"][name] = (dict(ps.counter.bytes), dict(ps.counter.calls))
        if name == "greedy":
            out["logprobs"] = [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in outputs[0].logprobs]
    stats = llm.spec_stats()
    out["engine"] = {
        "steps": llm.engine.stats.num_steps,
        "preemptions": llm.engine.stats.num_preemptions,
        "spec": None if stats is None else stats.as_dict(),
    }
    return out
