"""The ``eagle3-unshifted`` tests' models and reference (tests/proposers/test_eagle3_unshifted*.py).

Targets: a nearly bigram Llama with as many kv heads as heads (so the MHA oracle draft's K/V layout
matches every target layer's) and a DeepSeek-V3 MLA target whose latent matches the MLA oracle
draft's (eagle3_oracle.py), so drafts are often accepted; random drafts beside them. The reference
rows are written here from FACTS.md section 4 (unshifted rows: token p at position p, hidden h_(p-1),
a zero bootstrap at position 0; with sharing the draft's rows start at the prompt length and attend
over the target layer's cached K/V or latent at prompt positions), over eagle3_reference.py's draft
layer (the prefix expanded naively, no cache).
"""

from __future__ import annotations

import pytest
import torch
from eagle3_oracle import save_deepseek_target, save_llama_mha_target, target_output_weights, write_oracle_draft
from eagle3_reference import DraftSpec, Reference, make_weights, write_draft

from specdec import LLM, SamplingParams
from specdec.backends import get_backend
from specdec.cache import PagedKVCache
from specdec.models import load_model
from specdec.runtime.model_runner import Chunk, ModelRunner

PROMPTS = [[3, 17, 5, 9, 41, 2, 33, 8, 12], [7, 1, 60, 22, 22, 5, 14], [4], [10, 20, 30, 40, 50, 60, 11, 21, 31, 41]]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
MEMORY = 1 << 23
BLOCK = 4
MIX = 0.5  # random weight on the attention's hidden inputs, so the draft's KV depends on the hidden fed
LLAMA_LAYERS = 4
SPECS = {
    "llama": DraftSpec(layout="sglang", kv_heads=4, aux_ids=(0, 1, 3)),
    "deepseek": DraftSpec(layout="mla", kv_lora_rank=64, aux_ids=(0, 1, 2), fc_norm=True, draft_vocab=48),
}
# The default mapping: the last target layer whose KV layout is the draft's.
DEFAULT_LAYER = {"llama": LLAMA_LAYERS - 1, "deepseek": 2}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """``{name: (target folder, draft folder, Reference)}`` (:func:`build_models`), once per test module
    that imports it."""
    return build_models(tmp_path_factory.mktemp("unshifted"))


def build_models(root):
    """``{name: (target folder, draft folder, Reference)}``: "llama" and "deepseek" with accepting oracle
    drafts, "llama-random" and "deepseek-random" with random drafts, whose attention is spread over
    every key (the oracle's attends almost only to rows of its own token, so what it reads at prompt
    positions barely shows)."""
    targets = {"llama": save_llama_mha_target(root / "llama", num_layers=LLAMA_LAYERS, max_positions=256), "deepseek": save_deepseek_target(root / "deepseek")}
    out = {}
    for name, folder in targets.items():
        embed, lm_head = target_output_weights(folder)
        weights = write_oracle_draft(root / f"draft_{name}", SPECS[name], folder, mix=MIX)
        out[name] = (folder, root / f"draft_{name}", Reference(SPECS[name], weights, embed, lm_head))
        weights = make_weights(SPECS[name], seed=5)
        write_draft(root / f"random_{name}", SPECS[name], weights)
        out[f"{name}-random"] = (folder, root / f"random_{name}", Reference(SPECS[name], weights, embed, lm_head))
    return out


def spec_config(draft, k, **extra) -> dict:
    return {"method": "eagle3-unshifted", "model": str(draft), "num_speculative_tokens": k, **extra}


def make_llm(setup, name, k, memory=MEMORY, **extra) -> LLM:
    folder, draft, _ = setup[name]
    return LLM(str(folder), dtype="float64", block_size=BLOCK, kv_cache_memory=memory,
               speculative_config=spec_config(draft, k, **extra))


def record(llm: LLM, check=None) -> list[dict]:
    """Log every non-empty proposal (tokens, prompt length, drafts); ``check(seq)`` runs right after each."""
    proposer, log = llm.engine.proposer, []
    original = proposer.propose

    def propose(seqs, max_drafts):
        out = original(seqs, max_drafts)
        for seq, drafts in zip(seqs, out.draft_token_ids):
            if drafts:
                log.append({"request": seq.index, "tokens": list(seq.token_ids), "drafts": list(drafts)})
                if check is not None:
                    check(seq)
        return out

    proposer.propose = propose
    return log


# ----------------------------------------------------------------------------- the reference
def target_states(folder, aux_ids, sequences, layer: int | None):
    """Per sequence: (aux states ``[n, n_aux * H]``, the cached K/V or latent of target ``layer``) from
    one plain prefill of each whole sequence in a fresh specdec target and cache."""
    target = load_model(folder, dtype="float64")
    cache = PagedKVCache(MEMORY)
    pools = [cache.register(p) for p in target.kv_pools("target", 16, torch.float64)]
    cache.build()
    runner = ModelRunner(target, cache, get_backend("torch"), [p.name for p in pools])
    out = runner.forward([Chunk(i, s) for i, s in enumerate(sequences)], aux_ids)
    auxes = out.aux_hidden_states.split([len(s) for s in sequences])
    result = []
    for i, (seq, aux) in enumerate(zip(sequences, auxes)):
        kv = None
        if layer is not None:
            entries = cache.pool("target").layer(layer)
            blocks = torch.tensor(cache.block_table(i, "target"))
            kv = {key: t[blocks].flatten(0, 1)[: len(seq)].clone() for key, t in entries.items()}
        result.append((aux, kv))
    return result


def ref_rows(ref: Reference, tokens, aux, *, prompt_len=0, prefix=None, boot=None):
    """Unshifted rows over ``tokens`` (t_0..t_(n-1)): row p = (t_p, h_(p-1)) at position p, h_(-1) = boot
    (zeros by default). With a ``prefix`` (target KV of positions < prompt_len) rows start at prompt_len."""
    fused = ref.fuse(aux[: len(tokens) - 1])
    boot = torch.zeros(1, fused.shape[-1], dtype=fused.dtype) if boot is None else boot
    hidden = torch.cat([boot, fused])
    first = prompt_len if prefix is not None else 0
    prefix = None if prefix is None else {key: t[:prompt_len] for key, t in prefix.items()}
    return list(tokens[first:]), hidden[first:], first, prefix


def ref_drafts(ref: Reference, tokens, aux, k, *, prompt_len=0, prefix=None) -> list[int]:
    """Greedy chain of ``k`` drafts after the unshifted rows, recomputing everything at each step."""
    toks, hidden, first, prefix = ref_rows(ref, tokens, aux, prompt_len=prompt_len, prefix=prefix)
    drafts = []
    for _ in range(k):
        post, nxt = ref.layer(toks, hidden, torch.arange(first, first + len(toks)), prefix)
        draft = int(ref.target_ids[int(ref.logits(post[-1]).argmax())])
        drafts.append(draft)
        toks.append(draft)
        hidden = torch.cat([hidden, nxt[-1:]])
    return drafts
