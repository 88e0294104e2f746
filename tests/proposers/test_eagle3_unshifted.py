"""The ``eagle3-unshifted`` proposer, with and without KV sharing, in float64.

Targets: a nearly bigram Llama with as many kv heads as heads (so the MHA oracle draft's K/V layout
matches every target layer's) and a DeepSeek-V3 MLA target whose latent matches the MLA oracle
draft's (eagle3_oracle.py), so drafts are often accepted.

Checked: greedy losslessness against the non-speculative run for both modes, both targets, k in
{1, 3}, and every proposal against an independent reference written here from FACTS.md section 4
(unshifted rows: token p at position p, hidden h_(p-1), a zero bootstrap at position 0; with
sharing the draft's rows start at the prompt length and attend over the target layer's cached K/V
or latent at prompt positions, expanded naively, no cache); chunked target prefills; that the draft
pool holds no prompt pages with sharing; that the draft's prompt-position attention reads exactly
the mapped target layer (explicit computation over its cached K/V, poisoned other layers); the
layer mapping, its configuration and refusals; preemption.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from eagle3_oracle import save_deepseek_target, save_llama_mha_target, target_output_weights, write_oracle_draft
from eagle3_reference import (
    DraftSpec,
    Reference,
    make_weights,
    rms,
    rope_cos_sin,
    rope_halves,
    rope_pairs,
    write_draft,
)
from engine_harness import OneRequestEngine

from specdec import LLM, SamplingParams
from specdec.backends import get_backend
from specdec.cache import PagedKVCache
from specdec.models import load_model
from specdec.proposers.config import parse_speculative_config
from specdec.proposers.eagle3.unshifted import UnshiftedEagle3Proposer
from specdec.proposers.registry import create_proposer
from specdec.runtime.model_runner import Chunk, ModelRunner
from specdec.runtime.sequence import Sequence as EngineSequence

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
    """``{name: (target folder, draft folder, Reference)}``: "llama" and "deepseek" with accepting oracle
    drafts, "llama-random" and "deepseek-random" with random drafts, whose attention is spread over
    every key (the oracle's attends almost only to rows of its own token, so what it reads at prompt
    positions barely shows)."""
    root = tmp_path_factory.mktemp("unshifted")
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


@pytest.fixture(scope="module")
def baseline(setup):
    return {
        name: [o.token_ids for o in LLM(str(folder), dtype="float64", block_size=BLOCK, kv_cache_memory=MEMORY)
               .generate(PROMPTS, GREEDY, use_tqdm=False)]
        for name, (folder, _, _) in setup.items() if not name.endswith("-random")
    }


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


def _mha(w, s: DraftSpec, x, positions, prefix):
    a = "midlayer.self_attn."
    S = x.shape[0]
    q = (x @ w[a + "q_proj.weight"].T).view(S, s.heads, s.head_dim)
    k = (x @ w[a + "k_proj.weight"].T).view(S, s.kv_heads, s.head_dim)
    v = (x @ w[a + "v_proj.weight"].T).view(S, s.kv_heads, s.head_dim)
    cos, sin = rope_cos_sin(positions, s.head_dim, s.theta)
    q, k = rope_halves(q, cos, sin), rope_halves(k, cos, sin)
    if prefix is not None:  # the target's cached (roped) keys and values at the prompt positions
        k, v = torch.cat([prefix["k"], k]), torch.cat([prefix["v"], v])
    group = s.heads // s.kv_heads
    out = _attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), s.head_dim**-0.5)
    return out.reshape(S, -1) @ w[a + "o_proj.weight"].T


def _mla(w, s: DraftSpec, x, positions, prefix):
    """Naive MLA: every key and value expanded from its latent through the draft's kv_b_proj."""
    a = "midlayer.self_attn."
    S, nope, rope, rank = x.shape[0], s.nope, s.rope, s.kv_lora_rank
    q = (x @ w[a + "q_proj.weight"].T).view(S, s.heads, nope + rope)
    kv_a = x @ w[a + "kv_a_proj_with_mqa.weight"].T
    c = rms(kv_a[:, :rank], w[a + "kv_a_layernorm.weight"], s.eps)
    cos, sin = rope_cos_sin(positions, rope, s.theta)
    q_pe = rope_pairs(q[..., nope:], cos, sin)
    k_pe = rope_pairs(kv_a[:, None, rank:], cos, sin)
    if prefix is not None:  # the target's latent: normalised compressed KV, then the roped key part
        latent = prefix["latent"]
        c, k_pe = torch.cat([latent[:, :rank], c]), torch.cat([latent[:, None, rank:], k_pe])
    T = c.shape[0]
    kv = (c @ w[a + "kv_b_proj.weight"].T).view(T, s.heads, nope + s.v_head_dim)
    key = torch.cat([kv[..., :nope], k_pe.expand(T, s.heads, rope)], dim=-1)
    out = _attention(torch.cat([q[..., :nope], q_pe], dim=-1), key, kv[..., nope:], (nope + rope) ** -0.5)
    return out.reshape(S, -1) @ w[a + "o_proj.weight"].T


def _attention(q, k, v, scale):
    """Queries are the last ``S`` of ``T`` keys: query i sees keys ``<= T - S + i``."""
    S, T = q.shape[0], k.shape[0]
    scores = torch.einsum("shd,thd->hst", q, k) * scale
    mask = torch.ones(S, T, dtype=torch.bool).tril(diagonal=T - S)
    return torch.einsum("hst,thd->shd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def ref_layer(ref: Reference, tokens, hidden, positions, prefix=None):
    """The draft's layer over a whole row sequence, (post-norm, fed-back hidden)."""
    s, w, p = ref.spec, ref.w, "midlayer."
    embed = w.get("embed_tokens.weight", ref.target_embed)[torch.tensor(tokens)]
    e = rms(embed, w[p + "input_layernorm.weight"], s.eps)
    hn = rms(hidden, w[p + "hidden_norm.weight"], s.eps)
    x = torch.cat([e, hn], dim=-1)
    h = (hn if s.norm_before_residual else hidden) + (_mla if s.is_mla else _mha)(w, s, x, positions, prefix)
    m = rms(h, w[p + "post_attention_layernorm.weight"], s.eps)
    h = h + (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[
        p + "mlp.down_proj.weight"].T
    post = rms(h, w["norm.weight"], s.eps)
    return post, (post if s.norm_output else h)


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
        post, nxt = ref_layer(ref, toks, hidden, torch.arange(first, first + len(toks)), prefix)
        draft = int(ref.target_ids[int(ref.logits(post[-1]).argmax())])
        drafts.append(draft)
        toks.append(draft)
        hidden = torch.cat([hidden, nxt[-1:]])
    return drafts


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
        return ref_layer(ref, toks, hidden, torch.arange(first, first + len(toks)), pre)[0]

    torch.testing.assert_close(post, explicit(cached[mapped]), rtol=1e-12, atol=1e-12)
    # The check is sharp: another layer's K/V, or the draft's own prompt KV, give other states.
    for other in [i for i in range(pool.num_layers) if i != mapped][:2]:
        assert (post - explicit(cached[other])).abs().max() > 1e-6
    toks, hidden, _, _ = ref_rows(ref, seq.token_ids, aux)
    own = ref_layer(ref, toks, hidden, torch.arange(len(toks)))[0][-1:]
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
    want = ref_layer(ref, toks, hidden, torch.arange(len(toks)))[0]
    torch.testing.assert_close(post, want, rtol=1e-12, atol=1e-12)
    # Another bootstrap changes the states (row 0 and, through attention, the rest).
    ones = torch.ones(1, hidden.shape[-1], dtype=torch.float64)
    toks, hidden, _, _ = ref_rows(ref, seq.token_ids, out.aux_hidden_states, boot=ones)
    other = ref_layer(ref, toks, hidden, torch.arange(len(toks)))[0]
    assert (post[0] - other[0]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- mapping and configuration
def _rewrite_config(folder, **eagle):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.setdefault("eagle_config", {}).update(eagle)
    path.write_text(json.dumps(config))


def test_mapping_comes_from_config_then_checkpoint_then_default(setup, tmp_path):
    folder, draft, _ = setup["llama"]
    write_oracle_draft(tmp_path / "d", SPECS["llama"], folder)
    _rewrite_config(tmp_path / "d", kv_sharing_target_layers={"0": 1}, bootstrap_hidden="zeros")
    llm = LLM(str(folder), dtype="float64", block_size=BLOCK, kv_cache_memory=MEMORY,
              speculative_config=spec_config(tmp_path / "d", 2))
    assert llm.engine.proposer.shared_layer.target_layer == 1  # what the draft was trained with
    with pytest.warns(UserWarning, match="overrides the target layer 1 the draft was trained"):
        llm = LLM(str(folder), dtype="float64", block_size=BLOCK, kv_cache_memory=MEMORY,
                  speculative_config=spec_config(tmp_path / "d", 2, kv_sharing_target_layer=2))
    shared = llm.engine.proposer.shared_layer
    assert (shared.target_layer, shared.pool, shared.pool_layer) == (2, "target", 2)
    # The string form, and a chosen layer the reference can follow.
    llm = LLM(str(folder), dtype="float64", block_size=BLOCK, kv_cache_memory=MEMORY,
              speculative_config=f"eagle3-unshifted:model={draft},num_speculative_tokens=3,kv_sharing_target_layer=0")
    assert llm.engine.proposer.shared_layer.target_layer == 0
    log = record(llm)
    outputs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    ref = setup["llama"][2]
    states = target_states(folder, llm.engine.proposer.aux_layer_ids, [p + o.token_ids for p, o in
                                                                       zip(PROMPTS, outputs)], 0)
    for entry in log:
        aux, kv = states[entry["request"]]
        want = ref_drafts(ref, entry["tokens"], aux, len(entry["drafts"]),
                          prompt_len=len(PROMPTS[entry["request"]]), prefix=kv)
        assert entry["drafts"] == want


def test_configuration_and_refusals_name_the_fix(setup, tmp_path):
    llama, _, _ = setup["llama"]
    deepseek, mla_draft, _ = setup["deepseek"]
    cfg = parse_speculative_config("eagle3-unshifted:model=/d,num_speculative_tokens=2,kv_sharing_target_layer=0")
    assert (cfg.kv_sharing, cfg.kv_sharing_target_layer) == (True, 0)
    assert parse_speculative_config(cfg.to_string()) == cfg
    assert isinstance(create_proposer(cfg), UnshiftedEagle3Proposer)
    with pytest.raises(ValueError, match="kv_sharing_target_layer needs kv_sharing=true"):
        parse_speculative_config("eagle3-unshifted:model=/d,num_speculative_tokens=2,kv_sharing=false,"
                                 "kv_sharing_target_layer=1")
    with pytest.raises(ValueError, match="kv_sharing_target_layer must be an int >= 0"):
        parse_speculative_config({"method": "eagle3-unshifted", "model": "/d", "num_speculative_tokens": 2,
                                  "kv_sharing_target_layer": -1})
    with pytest.raises(ValueError, match="unknown key 'kv_sharing_target_layer' for method 'eagle3'"):
        parse_speculative_config({"method": "eagle3", "model": "/d", "num_speculative_tokens": 2,
                                  "kv_sharing_target_layer": 1})

    def build(target, draft, **extra):
        return LLM(str(target), dtype="float64", block_size=BLOCK, kv_cache_memory=MEMORY,
                   speculative_config=spec_config(draft, 2, **extra))

    # An MHA draft under the MLA target: no layer to share (but fine without sharing).
    write_oracle_draft(tmp_path / "mha", DraftSpec(layout="sglang", kv_heads=4, aux_ids=(0, 1, 2)), deepseek)
    with pytest.raises(ValueError, match="no target layer holds KV the draft can read.*MHA/GQA K/V of 4 kv heads x "
                                         "head_dim 8.*MLA latent of kv_lora_rank 64.*set kv_sharing=false"):
        build(deepseek, tmp_path / "mha")
    assert build(deepseek, tmp_path / "mha", kv_sharing=False).engine.proposer.shared_layer is None
    # A chosen layer with another layout, and one out of range.
    with pytest.raises(ValueError, match="target layer 1 .*kv_sharing_target_layer.* keeps an MLA latent.*MHA/GQA"):
        build(deepseek, tmp_path / "mha", kv_sharing_target_layer=1)
    with pytest.raises(ValueError, match="kv_sharing_target_layer is 9 but the target has layers 0..3"):
        build(llama, setup["llama"][1], kv_sharing_target_layer=9)
    # A GQA draft whose kv heads differ from the target's.
    gqa = DraftSpec(layout="sglang", kv_heads=2, aux_ids=(0, 1, 3))
    write_draft(tmp_path / "gqa", gqa, make_weights(gqa))
    with pytest.raises(ValueError, match="no target layer holds KV.*2 kv heads.*4 kv heads"):
        build(llama, tmp_path / "gqa")
    # The declared mapping and bootstrap are checked too.
    _rewrite_config(tmp_path / "mha", kv_sharing_target_layers={"1": 0})
    with pytest.raises(ValueError, match='must map the draft.s one layer to a target layer'):
        build(deepseek, tmp_path / "mha", kv_sharing=False)
    write_oracle_draft(tmp_path / "boot", SPECS["deepseek"], deepseek)
    _rewrite_config(tmp_path / "boot", bootstrap_hidden="learned")
    with pytest.raises(ValueError, match="bootstrap_hidden is 'learned'; supported: \\['zeros'\\]"):
        build(deepseek, tmp_path / "boot")
    with pytest.raises(ValueError, match="kv_sharing_target_layer needs kv_sharing=true"):
        UnshiftedEagle3Proposer(str(mla_draft), 2, kv_sharing=False, kv_sharing_target_layer=0)


def test_the_engine_page_size_check_sees_the_shared_pool(setup):
    """The draft reads the target's pages, so its backend must run their size (aiter: multiples of 16)."""
    from specdec.engine.compat import PageSizeError

    folder, draft, _ = setup["llama"]
    llm = make_llm(setup, "llama", 2)
    assert llm.engine.pools.draft.read == ("target",)
    assert make_llm(setup, "llama", 2, kv_sharing=False).engine.pools.draft.read == ()
    with pytest.raises(PageSizeError, match="target pool 'target' .*page 4.* cannot be read by the draft .KV sharing."):
        LLM(str(folder), dtype="float64", block_size=BLOCK, kv_cache_memory=MEMORY,
            speculative_config=spec_config(draft, 2, attention_backend="aiter", block_size=16))


def test_cache_sequences_that_start_past_the_prompt():
    """PagedKVCache.set_start: pages hold positions from the start, lengths stay logical."""
    from specdec.cache import AttentionPool, KVCacheError

    cache = PagedKVCache(1 << 20)
    for name, bs in (("target", 4), ("draft", 3)):
        cache.register(AttentionPool(name, num_layers=1, block_size=bs, num_kv_heads=1, head_dim=2,
                                     dtype=torch.float32))
    cache.build()
    cache.append_slots("r", 10, ["target"])
    cache.set_start("r", 10, ["draft"])
    assert (cache.num_tokens("r", "draft"), cache.blocks_held("r", "draft"), cache.sequence_start("r", "draft")) == (
        10, 0, 10)
    slots = cache.append_slots("r", 4, ["draft"])["draft"]  # positions 10..13: offsets 0..3 of the draft's pages
    table = cache.block_table("r", "draft")
    assert len(table) == 2 and slots.tolist() == [table[0] * 3, table[0] * 3 + 1, table[0] * 3 + 2, table[1] * 3]
    assert cache.num_tokens("r", "draft") == 14 and cache.can_admit("r", 16, ["draft"])
    cache.truncate("r", 12, ["draft"])
    assert cache.blocks_held("r", "draft") == 1 and cache.num_tokens("r", "draft") == 12
    with pytest.raises(KVCacheError, match="cannot truncate .* to 9 tokens: it has positions 10..11"):
        cache.truncate("r", 9, ["draft"])
    with pytest.raises(KVCacheError, match="already holds 2 tokens there; set the start before the first append"):
        cache.set_start("r", 0, ["draft"])
    cache.free("r")
    assert cache.num_free_blocks("draft") == cache.pool("draft").num_blocks and cache.sequence_start("r", "draft") == 0
