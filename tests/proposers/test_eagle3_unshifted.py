"""The ``eagle3-unshifted`` proposer, with and without KV sharing, in float64.

Targets: a nearly bigram Llama with as many kv heads as heads (so the MHA oracle draft's K/V layout
matches every target layer's) and a DeepSeek-V3 MLA target whose latent matches the MLA oracle
draft's (eagle3_oracle.py), so drafts are often accepted.

Checked: greedy losslessness against the non-speculative run for both modes, both targets, k in
{1, 3}, and every proposal against an independent reference (unshifted_harness.py, from FACTS.md
section 4); chunked target prefills; that the draft pool holds no prompt pages with sharing; that the
draft's prompt-position attention reads exactly the mapped target layer (explicit computation over
its cached K/V, poisoned other layers); preemption. The layer mapping, its configuration and
refusals: test_eagle3_unshifted_config.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from engine_harness import OneRequestEngine
from unshifted_harness import (
    BLOCK,
    DEFAULT_LAYER,
    GREEDY,
    MEMORY,
    PROMPTS,
    SPECS,
    make_llm,
    record,
    setup,
    ref_drafts,
    ref_rows,
    target_states,
)

from specdec import LLM, SamplingParams
from specdec.models import load_model
from specdec.proposers.eagle3.unshifted import UnshiftedEagle3Proposer
from specdec.runtime.sequence import Sequence as EngineSequence


@pytest.fixture(scope="module")
def baseline(setup):
    return {
        name: [o.token_ids for o in LLM(str(folder), dtype="float64", block_size=BLOCK, kv_cache_memory=MEMORY)
               .generate(PROMPTS, GREEDY, use_tqdm=False)]
        for name, (folder, _, _) in setup.items() if not name.endswith("-random")
    }


# ----------------------------------------------------------------------------- losslessness
def check_proposals(setup, name, llm, log, outputs, kv_sharing):
    """Every logged proposal equals the reference's drafts for its tokens."""
    folder, _, ref = setup[name]
    proposer = llm.engine.proposer
    assert proposer.aux_layer_ids == SPECS[name.removesuffix("-random")].aux_ids
    layer = DEFAULT_LAYER[name.removesuffix("-random")] if kv_sharing else None
    assert (proposer.shared_layer.target_layer if kv_sharing else None) == layer
    finals = [p + o.token_ids for p, o in zip(PROMPTS, outputs)]
    states = target_states(folder, proposer.aux_layer_ids, finals, layer)
    first = {}
    for entry in log:
        request, tokens = entry["request"], entry["tokens"]
        first.setdefault(request, len(tokens))
        aux, kv = states[request]
        want = ref_drafts(ref, tokens, aux, len(entry["drafts"]), prompt_len=len(PROMPTS[request]), prefix=kv)
        assert entry["drafts"] == want, f"request {request} at {len(tokens)} tokens"
    assert first == {i: len(p) + 1 for i, p in enumerate(PROMPTS)}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("kv_sharing", [False, True])
@pytest.mark.parametrize("name", ["llama", "deepseek"])
def test_greedy_lossless_and_every_proposal_matches_the_reference(name, kv_sharing, k, setup, baseline):
    llm = make_llm(setup, name, k, kv_sharing=kv_sharing)
    log = record(llm)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == baseline[name]
    stats = llm.spec_stats()
    assert stats.accepted_per_position[0] > 0 and stats.accepted_per_position[-1] > 0, stats.acceptance_per_position
    check_proposals(setup, name, llm, log, outputs, kv_sharing)


@pytest.mark.parametrize("kv_sharing", [False, True])
@pytest.mark.parametrize("name", ["llama-random", "deepseek-random"])
def test_random_drafts_match_the_reference(name, kv_sharing, setup, baseline):
    """Random drafts attend over every key, so a wrong prompt KV source would change their drafts."""
    llm = make_llm(setup, name, 3, kv_sharing=kv_sharing)
    log = record(llm)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == baseline[name.removesuffix("-random")]
    check_proposals(setup, name, llm, log, outputs, kv_sharing)


@pytest.mark.parametrize("kv_sharing", [False, True])
def test_lossless_under_preemption_with_mixed_sampling(kv_sharing, setup, baseline):
    roomy = make_llm(setup, "llama", 3, kv_sharing=kv_sharing)
    per_token = sum(p.bytes_per_token() for p in roomy.engine.cache.pools.values())
    llm = make_llm(setup, "llama", 3, memory=per_token * 2 * 32, kv_sharing=kv_sharing)
    sampled = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=3, ignore_eos=True)
    outputs = llm.generate(PROMPTS, [GREEDY, sampled, GREEDY, GREEDY], use_tqdm=False)
    assert llm.engine.stats.num_preemptions > 0
    for i in (0, 2, 3):
        assert outputs[i].token_ids == baseline["llama"][i]
    assert len(outputs[1].token_ids) == 20
    cache = llm.engine.cache
    assert cache.requests() == [] and llm.engine.proposer._states == {}
    assert all(cache.num_free_blocks(n) == p.num_blocks for n, p in cache.pools.items())


# ----------------------------------------------------------------------------- memory
@pytest.mark.parametrize("kv_sharing", [False, True])
def test_the_shared_draft_pool_holds_no_prompt_pages(kv_sharing, setup):
    llm = make_llm(setup, "llama", 3, kv_sharing=kv_sharing)
    cache = llm.engine.cache
    assert llm.engine.pools.draft.own == ("draft",) and list(cache.pools) == ["target", "draft"]
    bs = cache.pool("draft").block_size
    seen = []

    def check(seq):
        # Right after proposing, the draft keeps its true-hidden rows: positions start..n-1.
        n, prompt = seq.num_tokens, seq.num_prompt_tokens
        start = prompt if kv_sharing else 0
        assert cache.sequence_start(seq.seq_id, "draft") == start
        assert cache.num_tokens(seq.seq_id, "draft") == n
        assert cache.blocks_held(seq.seq_id, "draft") == math.ceil((n - start) / bs)
        assert cache.sequence_start(seq.seq_id, "target") == 0
        seen.append((n - prompt, cache.blocks_held(seq.seq_id, "draft")))

    record(llm, check)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert seen
    # The first proposal after a prompt: one draft row with sharing, prompt + 1 rows without.
    firsts = [blocks for generated, blocks in seen if generated == 1]
    if kv_sharing:
        assert firsts == [1] * len(PROMPTS)
    else:
        assert sorted(firsts) == sorted(math.ceil((len(p) + 1) / bs) for p in PROMPTS)
    assert cache.requests() == []


# ----------------------------------------------------------------------------- unit-level harness
def engine_parts(setup, name, k=3, **kwargs):
    folder, draft, _ = setup[name]
    proposer = UnshiftedEagle3Proposer(str(draft), k, block_size=3, **kwargs)
    return OneRequestEngine(load_model(folder, dtype="float64"), proposer, block_size=BLOCK, memory=MEMORY)


def prefill(engine, prompt, bounds, k=3):
    """Target prefill of ``prompt`` in chunks, telling the proposer after each and asking for drafts."""
    seq = EngineSequence(0, prompt, GREEDY, seed=0, max_model_len=256)
    proposer, proposals = engine.proposer, []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        engine.forward(seq, prompt[lo:hi])
        drafts = proposer.propose([seq], [k]).draft_token_ids[0]
        proposals.append((drafts, proposer.cache.num_tokens(seq.seq_id, "draft"),
                          proposer.cache.blocks_held(seq.seq_id, "draft")))
    return seq, proposals


@pytest.mark.parametrize("kv_sharing", [False, True])
@pytest.mark.parametrize("name", ["llama", "deepseek"])
def test_chunked_target_prefill(name, kv_sharing, setup):
    folder, _, ref = setup[name]
    prompt = PROMPTS[3] + PROMPTS[0]
    engine = engine_parts(setup, name, kv_sharing=kv_sharing)
    cache, proposer = engine.cache, engine.proposer
    seq, proposals = prefill(engine, prompt, [0, 5, 11, len(prompt)])
    P, bs = len(prompt), cache.pool("draft").block_size
    if kv_sharing:
        # Nothing runs mid-prefill (every row there is a prompt position; the draft's sequence starts at
        # P with no page); then one row, at position P.
        assert [p[1:] for p in proposals] == [(P, 0), (P, 0), (P + 1, 1)]
    else:
        # Row p needs t_p and h_(p-1): a chunk ending at e lets rows 0..e run (position e: a prompt token).
        assert [p[1:] for p in proposals] == [(e, math.ceil(e / bs)) for e in (6, 12, P + 1)]
    assert [len(p[0]) for p in proposals] == [0, 0, 3]
    _, whole = prefill(engine_parts(setup, name, kv_sharing=kv_sharing), prompt, [0, len(prompt)])
    assert whole[-1][0] == proposals[-1][0]
    layer = DEFAULT_LAYER[name] if kv_sharing else None
    aux, kv = target_states(folder, proposer.aux_layer_ids, [seq.token_ids], layer)[0]
    assert proposals[-1][0] == ref_drafts(ref, seq.token_ids, aux, 3, prompt_len=len(prompt), prefix=kv)


def test_a_prompt_whose_last_token_is_uncached_waits_with_sharing(setup):
    """A target that cached all but the last prompt token: the shared draft has no row to draft from."""
    engine = engine_parts(setup, "llama")
    cache, proposer = engine.cache, engine.proposer
    prompt = PROMPTS[0]
    seq = EngineSequence(0, prompt, GREEDY, seed=0, max_model_len=256)
    engine.forward(seq, prompt[:-1])
    assert proposer.propose([seq], [3]).draft_token_ids == [[]]
    assert cache.blocks_held(0, "draft") == 0


# ----------------------------------------------------------------------------- what the draft reads
def first_rows(proposer, seq, k=1):
    """Propose once, returning the post-norm states of the draft's first forward (its catch-up rows)."""
    calls = []
    original = proposer.draft.forward

    def forward(ids, positions, hidden, ctx):
        out = original(ids, positions, hidden, ctx)
        calls.append((positions.clone(), out[0].clone()))
        return out

    proposer.draft.forward = forward
    try:
        proposer.propose([seq], [k])
    finally:
        del proposer.draft.forward
    return calls[0]


def _poison(pool, layers) -> None:
    for layer in layers:
        for tensor in pool.layer(layer).values():
            tensor.fill_(float("nan"))


@pytest.mark.parametrize("name", ["llama-random", "deepseek-random"])
def test_prompt_attention_reads_exactly_the_mapped_target_layer(name, setup):
    folder, _, ref = setup[name]
    prompt = PROMPTS[0] + PROMPTS[1]
    engine = engine_parts(setup, name)
    cache, proposer = engine.cache, engine.proposer
    seq = EngineSequence(0, prompt, GREEDY, seed=0, max_model_len=256)
    out = engine.forward(seq, prompt)
    mapped = DEFAULT_LAYER[name.removesuffix("-random")]
    pool = cache.pool("target")
    blocks = torch.tensor(cache.block_table(0, "target"))
    cached = [{key: t[blocks].flatten(0, 1)[: len(prompt)].clone() for key, t in pool.layer(i).items()}
              for i in range(pool.num_layers)]
    # Every other target layer poisoned: the draft must not read any of them.
    _poison(pool, [i for i in range(pool.num_layers) if i != mapped])
    positions, post = first_rows(proposer, seq)
    assert positions.tolist() == [len(prompt)] and torch.isfinite(post).all()

    aux = out.aux_hidden_states.double()
    def explicit(prefix):
        toks, hidden, first, pre = ref_rows(ref, seq.token_ids, aux, prompt_len=len(prompt), prefix=prefix)
        return ref.layer(toks, hidden, torch.arange(first, first + len(toks)), pre)[0]

    torch.testing.assert_close(post, explicit(cached[mapped]), rtol=1e-12, atol=1e-12)
    # The check is sharp: another layer's K/V, or the draft's own prompt KV, give other states.
    for other in [i for i in range(pool.num_layers) if i != mapped][:2]:
        assert (post - explicit(cached[other])).abs().max() > 1e-6
    toks, hidden, _, _ = ref_rows(ref, seq.token_ids, aux)
    own = ref.layer(toks, hidden, torch.arange(len(toks)))[0][-1:]
    assert (post - own).abs().max() > 1e-6
    # Whatever the mapped layer holds is what the draft reads: overwrite it and the draft follows.
    gen = torch.Generator().manual_seed(0)
    for tensor in pool.layer(mapped).values():
        tensor.copy_(torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype))
    replaced = {key: t[blocks].flatten(0, 1)[: len(prompt)].clone() for key, t in pool.layer(mapped).items()}
    positions, again = first_rows(proposer, seq)
    assert positions.tolist() == [len(prompt)] and (again - post).abs().max() > 1e-3
    torch.testing.assert_close(again, explicit(replaced), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["llama-random", "deepseek-random"])
def test_unshifted_rows_and_bootstrap_without_sharing(name, setup):
    """The prefill runs N + 1 rows at positions 0..N: (t_p, h_(p-1)), a zero bootstrap hidden at 0."""
    _, _, ref = setup[name]
    prompt = PROMPTS[0]
    engine = engine_parts(setup, name, kv_sharing=False)
    proposer = engine.proposer
    seq = EngineSequence(0, prompt, GREEDY, seed=0, max_model_len=256)
    out = engine.forward(seq, prompt)
    positions, post = first_rows(proposer, seq)
    assert positions.tolist() == list(range(len(prompt) + 1))
    toks, hidden, _, _ = ref_rows(ref, seq.token_ids, out.aux_hidden_states)
    want = ref.layer(toks, hidden, torch.arange(len(toks)))[0]
    torch.testing.assert_close(post, want, rtol=1e-12, atol=1e-12)
    # Another bootstrap changes the states (row 0 and, through attention, the rest).
    ones = torch.ones(1, hidden.shape[-1], dtype=torch.float64)
    toks, hidden, _, _ = ref_rows(ref, seq.token_ids, out.aux_hidden_states, boot=ones)
    other = ref.layer(toks, hidden, torch.arange(len(toks)))[0]
    assert (post[0] - other[0]).abs().max() > 1e-3
