"""The EAGLE3 proposer inside the engine versus an independent from-scratch reference, in float64.

Targets are nearly bigram and the drafts built to follow them (eagle3_oracle.py), so drafts are
often accepted and the proposer's state after accepted steps is really exercised. Every proposal the
engine asks for is recorded; for each, the reference in eagle3_reference.py recomputes the draft's
whole sequence from the raw weights (shifted prefill over the verified tokens with the target's
hidden states, then the chain) with full causal attention and no cache, and must give the same
drafts. Further checks: sampled drafts' q, chunked target prefills, where the draft's KV lives and
that drafting leaves no KV behind, and the configuration errors.
"""

from __future__ import annotations

import pytest
import torch
from eagle3_oracle import save_deepseek_target, save_llama_target, target_output_weights, write_oracle_draft
from eagle3_reference import DraftSpec, Reference
from engine_harness import OneRequestEngine

from specdec import LLM, SamplingParams
from specdec.backends import get_backend
from specdec.cache import PagedKVCache
from specdec.models import CheckpointError, load_model
from specdec.proposers.eagle3.proposer import Eagle3Proposer
from specdec.runtime.model_runner import Chunk, ModelRunner
from specdec.runtime.sequence import Sequence as EngineSequence
from specdec.sampling.processing import target_probs

PROMPTS = [[3, 17, 5, 9, 41, 2, 33, 8, 12], [7, 1, 60, 22, 22, 5, 14], [4], [10, 20, 30, 40, 50, 60, 11, 21, 31, 41]]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
MEMORY = 1 << 23
# Random weight on the draft attention's hidden inputs: its KV must depend on the hidden states fed,
# or keeping the drafting-time KV (instead of recomputing it from the target's) would go unnoticed.
MIX = 0.5


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_targets")
    return {"llama": save_llama_target(root / "llama"), "deepseek": save_deepseek_target(root / "deepseek")}


# Each published layout, the 3.1 flags and the other norm switches, reduced vocabularies, shared or
# own embedding / lm_head. MHA oracles need kv_heads = heads; the MLA ones a latent of 2H.
CASES = {
    "eagle-default-aux-reduced": ("llama", DraftSpec(layout="eagle", kv_heads=4, aux_ids=None, draft_vocab=40)),
    "sglang-3.1-shared-head": (
        "llama",
        DraftSpec(layout="sglang", kv_heads=4, fc_norm=True, norm_output=True, flags_in_eagle_config=True,
                  own_lm_head=False),
    ),
    "sglang_model-fc_norm-reduced": (
        "llama", DraftSpec(layout="sglang_model", kv_heads=4, fc_norm=True, draft_vocab=48)
    ),
    "vllm-norm_output-norm_before_residual": (
        "llama", DraftSpec(layout="vllm", kv_heads=4, norm_output=True, norm_before_residual=True)
    ),
    "vllm_model-own-embed-norm_before_fc-reduced": (
        "llama", DraftSpec(layout="vllm_model", kv_heads=4, own_embed=True, norm_before_fc=True, draft_vocab=40)
    ),
    "mla-own-pool-3.1-reduced": (
        "llama", DraftSpec(layout="mla", kv_lora_rank=64, fc_norm=True, norm_output=True, draft_vocab=40)
    ),
    "mla-in-target-pool-fc_norm": (
        "deepseek", DraftSpec(layout="mla", kv_lora_rank=64, aux_ids=(0, 1, 2), fc_norm=True, own_lm_head=False)
    ),
    "mla-in-target-pool-3.1-reduced": (
        "deepseek",
        DraftSpec(layout="mla", kv_lora_rank=64, aux_ids=(0, 1, 2), fc_norm=True, norm_output=True, draft_vocab=48),
    ),
    "mha-under-mla-target": ("deepseek", DraftSpec(layout="vllm", kv_heads=4, aux_ids=(0, 1, 2), draft_vocab=48)),
}


# ----------------------------------------------------------------------------- helpers
def record_proposals(llm: LLM) -> list[dict]:
    """Log every ``propose`` call's inputs and outputs (the proposer itself runs unchanged)."""
    proposer, log = llm.engine.proposer, []
    original = proposer.propose

    def propose(seqs, max_drafts):
        out = original(seqs, max_drafts)
        for i, seq in enumerate(seqs):
            if out.draft_token_ids[i]:
                log.append({
                    "request": seq.index,
                    "tokens": list(seq.token_ids),
                    "drafts": list(out.draft_token_ids[i]),
                    "probs": None if out.draft_probs is None else out.draft_probs[i].clone(),
                    "params": seq.params,
                })
        return out

    proposer.propose = propose
    return log


def target_aux(folder, aux_ids, sequences) -> list[torch.Tensor]:
    """Aux states of each full sequence from a fresh target and cache (one plain prefill each)."""
    target = load_model(folder, dtype="float64")
    cache = PagedKVCache(MEMORY)
    pools = [cache.register(p) for p in target.kv_pools("target", 16, torch.float64)]
    cache.build()
    runner = ModelRunner(target, cache, get_backend("torch"), [p.name for p in pools])
    chunks = [Chunk(i, s) for i, s in enumerate(sequences)]
    out = runner.forward(chunks, aux_ids)
    return list(out.aux_hidden_states.split([len(s) for s in sequences]))


def reference_for(folder, spec, weights) -> Reference:
    embed, lm_head = target_output_weights(folder)
    return Reference(spec, weights, embed, lm_head)


def forced_chain_logits(ref: Reference, tokens: list[int], aux: torch.Tensor, drafts: list[int]) -> list[torch.Tensor]:
    """Draft-vocabulary logits of each draft position, feeding the given drafts (sampled ones) back."""
    seq, hidden = list(tokens), ref.fuse(aux)
    logits = []
    for draft in drafts:
        post, nxt = ref.layer(seq, hidden, torch.arange(len(seq)))
        logits.append(ref.logits(post[-1]))
        seq.append(draft)
        hidden = torch.cat([hidden, nxt[-1:]])
    return logits


def spec_config(folder, k: int, method: str = "eagle3", **extra) -> dict:
    return {"method": method, "model": str(folder), "num_speculative_tokens": k, **extra}


# ----------------------------------------------------------------------------- against the reference
SAMPLED = SamplingParams(max_tokens=20, temperature=0.9, top_k=30, top_p=0.95, seed=7, ignore_eos=True)
MIXED = [GREEDY, SAMPLED, GREEDY, SAMPLED]


def check_proposals(log, ref: Reference, auxes, vocab: int) -> int:
    """Each logged proposal against the reference; returns how many drafts were checked.

    Greedy requests: the drafts equal the reference's greedy chain. Sampled requests: q of every
    draft equals ``target_probs`` of the reference's logits given the drafts actually drawn before
    it (a tight numerical check of the whole draft state), and the draft has mass under q.
    """
    checked = 0
    for entry in log:
        tokens, drafts, p, probs = entry["tokens"], entry["drafts"], entry["params"], entry["probs"]
        n = len(tokens)
        aux = auxes[entry["request"]][: n - 1]
        if p.temperature == 0:
            theirs = ref.chain(tokens[1:], aux, len(drafts))["drafts"]
            assert drafts == theirs, f"request {entry['request']} at {n} tokens"
            checked += len(drafts)
            continue
        for j, (draft, logits) in enumerate(zip(drafts, forced_chain_logits(ref, tokens[1:], aux, drafts))):
            full = torch.full((1, vocab), float("-inf"), dtype=torch.float64)
            full[0, ref.target_ids] = logits
            want = target_probs(full, torch.tensor([p.temperature], dtype=torch.float64), torch.tensor([p.top_k]),
                                torch.tensor([p.top_p], dtype=torch.float64))[0]
            assert torch.allclose(probs[j], want, rtol=0, atol=1e-10), f"request {entry['request']} draft {j}"
            assert want[draft] > 0
            checked += 1
    return checked


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_proposal_matches_the_reference(case, targets, tmp_path):
    target_name, spec = CASES[case]
    folder = targets[target_name]
    weights = write_oracle_draft(tmp_path / "draft", spec, folder, mix=MIX)
    k = 5 if case.startswith("sglang-3.1") else 3
    llm = LLM(str(folder), dtype="float64", block_size=4, kv_cache_memory=MEMORY,
              speculative_config=spec_config(tmp_path / "draft", k))
    log = record_proposals(llm)
    outputs = llm.generate(PROMPTS, MIXED, use_tqdm=False)
    stats = llm.spec_stats()
    # The check means something only if drafts were accepted, several in a row too.
    assert stats.accepted_per_position[0] > 0 and stats.accepted_per_position[1] > 0, stats.acceptance_per_position

    ref = reference_for(folder, spec, weights)
    finals = [p + o.token_ids for p, o in zip(PROMPTS, outputs)]
    auxes = target_aux(folder, llm.engine.proposer.aux_layer_ids, finals)
    assert check_proposals(log, ref, auxes, llm.engine.model.vocab_size) > 40
    # The first proposal of each request comes right after its prompt (plus the first sampled token).
    first = {}
    for entry in log:
        first.setdefault(entry["request"], len(entry["tokens"]))
    assert first == {i: len(p) + 1 for i, p in enumerate(PROMPTS)}
    assert all(e["probs"] is not None or e["params"].temperature == 0 for e in log)


@pytest.mark.parametrize("case", ["sglang_model-fc_norm-reduced", "mla-in-target-pool-fc_norm"])
def test_a_request_left_without_drafts_waits_to_catch_up_and_then_drafts_as_the_reference(case, targets, tmp_path):
    """The adaptive controller gives some requests of a step no drafts: the draft forwards run over the
    drafting requests only, and a request's rows wait until it drafts again (in a pool of the draft's
    own, or the target's MLA pool), then give the reference's drafts."""
    target_name, spec = CASES[case]
    folder = targets[target_name]
    weights = write_oracle_draft(tmp_path / "draft", spec, folder, mix=MIX)
    llm = LLM(str(folder), dtype="float64", block_size=4, kv_cache_memory=MEMORY,
              speculative_config=spec_config(tmp_path / "draft", 3))
    proposer = llm.engine.proposer
    forwards, steps, proposing = [], iter(range(10**6)), False
    run_forward, propose_all = proposer._forward, proposer.propose

    def forward(requests, tokens, positions, hidden):
        if proposing:  # not a finished request's completion for the prefix cache (after the step)
            forwards[-1].append(set(requests))
        return run_forward(requests, tokens, positions, hidden)

    def propose(seqs, max_drafts):  # request i sits out every third step, from step i on
        nonlocal proposing
        step = next(steps)
        allowed = [0 if (step - seq.index) % 3 == 0 else m for seq, m in zip(seqs, max_drafts)]
        forwards.append([{s.seq_id for s, m in zip(seqs, allowed) if m}])
        proposing = True
        try:
            return propose_all(seqs, allowed)
        finally:
            proposing = False

    proposer._forward, proposer.propose = forward, propose
    log = record_proposals(llm)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(drafting) < 4 for drafting, *_ in forwards[4:]) and len(forwards) > 10
    # Every draft forward of a step (catch-up, then the chain) runs drafting requests only.
    assert all(ran <= drafting for drafting, *runs in forwards for ran in runs)
    finals = [p + o.token_ids for p, o in zip(PROMPTS, outputs)]
    auxes = target_aux(folder, proposer.aux_layer_ids, finals)
    assert check_proposals(log, reference_for(folder, spec, weights), auxes, llm.engine.model.vocab_size) > 40
    assert llm.spec_stats().accepted_per_position[1] > 0


def test_sampled_drafts_are_seeded_and_greedy_steps_report_no_q(targets, tmp_path):
    folder = targets["llama"]
    write_oracle_draft(tmp_path / "draft", DraftSpec(layout="sglang", kv_heads=4, draft_vocab=40), folder)

    def run(prompts, params):
        llm = LLM(str(folder), dtype="float64", block_size=4, kv_cache_memory=MEMORY,
                  speculative_config=spec_config(tmp_path / "draft", 3))
        log = record_proposals(llm)
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)], log

    mixed, _ = run(PROMPTS, MIXED)
    alone, _ = run([PROMPTS[1]], [SAMPLED])
    assert alone[0] == mixed[1]  # a seeded request samples the same tokens whatever shares its steps
    _, log = run(PROMPTS, GREEDY)
    assert log and all(e["probs"] is None for e in log)


# ----------------------------------------------------------------------------- chunked prefill
def _engine_parts(folder, draft, k=3, *, method="eagle3", block_size=4, draft_block=None):
    proposer = Eagle3Proposer(str(draft), k, method=method, block_size=draft_block)
    return OneRequestEngine(load_model(folder, dtype="float64"), proposer, block_size=block_size, memory=MEMORY)


def _prefill_in_chunks(engine, prompt, bounds):
    """Target prefill of ``prompt`` in chunks, telling the proposer after each; returns the sequence."""
    seq = EngineSequence(0, prompt, GREEDY, seed=0, max_model_len=256)
    proposer, proposals = engine.proposer, []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        engine.forward(seq, prompt[lo:hi])
        proposals.append((proposer.propose([seq], [3]).draft_token_ids[0], proposer._states[0].done))
    return seq, proposals


@pytest.mark.parametrize("case", ["sglang_model-fc_norm-reduced", "mla-in-target-pool-3.1-reduced"])
def test_chunked_target_prefill(case, targets, tmp_path):
    """Mid-prefill the draft catches up on what it can and drafts nothing; then drafts as unchunked."""
    target_name, spec = CASES[case]
    folder = targets[target_name]
    weights = write_oracle_draft(tmp_path / "draft", spec, folder)
    prompt = PROMPTS[3] + PROMPTS[0]
    engine = _engine_parts(folder, tmp_path / "draft")
    proposer = engine.proposer
    seq, proposals = _prefill_in_chunks(engine, prompt, [0, 5, 11, len(prompt)])
    # Rows 0..4, then 5..10 ran as soon as their target states came; the last needs the sampled token.
    assert proposals[:2] == [([], 5), ([], 11)]
    drafts, done = proposals[2]
    assert len(drafts) == 3 and done == len(prompt)
    _, whole = _prefill_in_chunks(_engine_parts(folder, tmp_path / "draft"), prompt, [0, len(prompt)])
    assert whole[-1][0] == drafts
    ref = reference_for(folder, spec, weights)
    aux = target_aux(folder, proposer.aux_layer_ids, [seq.token_ids])[0]
    assert drafts == ref.chain(seq.token_ids[1:], aux[: len(prompt)], 3)["drafts"]


# ----------------------------------------------------------------------------- pools and bookkeeping
def test_drafting_leaves_only_true_hidden_kv(targets, tmp_path):
    """Right after proposing, the draft holds KV for the verified tokens only (chain rows dropped)."""
    folder = targets["llama"]
    write_oracle_draft(tmp_path / "draft", DraftSpec(layout="sglang", kv_heads=4), folder)
    llm = LLM(str(folder), dtype="float64", block_size=4, kv_cache_memory=MEMORY,
              speculative_config=spec_config(tmp_path / "draft", 5, block_size=3))
    proposer, cache = llm.engine.proposer, llm.engine.cache
    assert llm.engine.pools.draft.own == ("draft",) and cache.pool("draft").block_size == 3
    assert llm.engine.aux_layer_ids == proposer.aux_layer_ids == (0, 3, 7)
    seen = []
    original = proposer.propose

    def propose(seqs, max_drafts):
        out = original(seqs, max_drafts)
        for seq, d in zip(seqs, out.draft_token_ids):
            if d:
                seen.append(1)
                assert cache.num_tokens(seq.seq_id, "draft") == seq.num_tokens - 1
                assert cache.num_tokens(seq.seq_id, "target") == seq.num_tokens - 1
        return out

    proposer.propose = propose
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert seen
    assert cache.requests() == [] and proposer._states == {}
    assert all(cache.num_free_blocks(n) == p.num_blocks for n, p in cache.pools.items())


def test_mla_draft_lives_in_the_target_pool(targets, tmp_path):
    folder = targets["deepseek"]
    _, spec = CASES["mla-in-target-pool-fc_norm"]
    write_oracle_draft(tmp_path / "draft", spec, folder)
    for method in ("eagle3.1-mla", "eagle3"):
        llm = LLM(str(folder), dtype="float64", block_size=1, kv_cache_memory=MEMORY,
                  speculative_config=spec_config(tmp_path / "draft", 3, method))
        proposer, cache = llm.engine.proposer, llm.engine.cache
        assert list(cache.pools) == ["target"] and llm.engine.pools.draft.own == ()
        assert cache.pool("target").num_layers == 4  # 3 target layers + the draft's
        attn = proposer.draft.midlayer.self_attn
        assert (attn.pool, attn.layer_idx) == ("target", 3)
    # eagle3 with another page size gives the MLA draft a pool of its own instead.
    llm = LLM(str(folder), dtype="float64", block_size=1, kv_cache_memory=MEMORY,
              speculative_config=spec_config(tmp_path / "draft", 3, block_size=16))
    assert llm.engine.cache.pool("target").num_layers == 3
    assert llm.engine.cache.pool("draft").block_size == 16


def test_configuration_errors_name_the_fix(targets, tmp_path):
    llama, deepseek = str(targets["llama"]), str(targets["deepseek"])
    write_oracle_draft(tmp_path / "mha", DraftSpec(layout="sglang", kv_heads=4, aux_ids=(0, 1, 2)), targets["deepseek"])
    write_oracle_draft(tmp_path / "mla", CASES["mla-in-target-pool-fc_norm"][1], targets["deepseek"])
    write_oracle_draft(tmp_path / "mla_llama", CASES["mla-own-pool-3.1-reduced"][1], targets["llama"])
    with pytest.raises(CheckpointError, match="needs an MLA draft.*use method 'eagle3'"):
        LLM(deepseek, kv_cache_memory=MEMORY, speculative_config=spec_config(tmp_path / "mha", 2, "eagle3.1-mla"))
    with pytest.raises(CheckpointError, match="has no MLA attention"):
        LLM(llama, kv_cache_memory=MEMORY, speculative_config=spec_config(tmp_path / "mla_llama", 2, "eagle3.1-mla"))
    with pytest.raises(ValueError, match="block_size=16.*pages are 1 tokens.*set it to 1"):
        LLM(deepseek, block_size=1, kv_cache_memory=MEMORY,
            speculative_config=spec_config(tmp_path / "mla", 2, "eagle3.1-mla", block_size=16))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Eagle3Proposer(str(tmp_path / "mla"), 0)
    with pytest.raises(ValueError, match="unknown EAGLE3 proposer method"):
        Eagle3Proposer(str(tmp_path / "mla"), 2, method="eagle4")
