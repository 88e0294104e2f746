"""EAGLE3 drafts over the paged cache versus an independent from-scratch reference, in float64.

For each checkpoint layout and flag combination: a batch of ragged prompts goes through the specdec
target (capturing the draft's aux layers), then the draft runs a shifted prefill (optionally in two
chunks) and a greedy chain of draft steps over its paged KV. The reference in eagle3_reference.py
recomputes every step from the raw weights with full causal attention and no cache.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from eagle3_reference import (
    DraftSpec,
    Reference,
    make_weights,
    save_deepseek_target,
    save_llama_target,
    write_draft,
)

from specdec.backends import get_backend
from specdec.backends.base import AttentionMetadata
from specdec.cache import PagedKVCache
from specdec.runtime.model_runner import Chunk, ModelRunner, last_token_indices
from specdec.models import ForwardContext, load_model
from specdec.proposers.eagle3 import load_eagle3_draft

PROMPTS = [[3, 17, 5, 9, 41, 2, 33, 8, 12], [7, 1, 60, 22, 22, 5, 14, 9, 30, 11, 2, 48, 6, 19]]
RTOL = 1e-9


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_target")
    hf = save_llama_target(folder)
    return load_model(folder, dtype="float64"), hf


@pytest.fixture(scope="module")
def deepseek_target(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepseek_target")
    save_deepseek_target(folder)
    return load_model(folder, dtype="float64")


# ----------------------------------------------------------------------------- paged driver
def _metadata(cache: PagedKVCache, pool: str, requests, positions) -> AttentionMetadata:
    """Metadata for queries at ``positions[i]`` (contiguous) of each request, growing its pages as needed.

    Slots come from the pool's block table, so this works for the draft's own pool and for layers the
    draft holds in the target's MLA pool (where draft position p uses the target's page for p).
    """
    bs = cache.pool(pool).block_size
    slots, query_lens, seq_lens = [], [], []
    for request, pos in zip(requests, positions):
        end = pos[-1] + 1
        have = cache.num_tokens(request, pool)
        if end > have:
            cache.append_slots(request, end - have, [pool])
        table = cache.block_table(request, pool)
        slots += [table[p // bs] * bs + p % bs for p in pos]
        query_lens.append(len(pos))
        seq_lens.append(end)
    return AttentionMetadata.build(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=cache.block_tables(requests, pool),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=bs,
    )


def paged_chain(target, draft, prompts, k, *, chunks=1, draft_block=4, target_block=16, share_mla_pool=False):
    """Target prefill, then the draft's shifted prefill (in ``chunks`` pieces) and ``k`` greedy draft steps."""
    dtype = torch.float64
    cache = PagedKVCache(1 << 24)
    target_pools = target.kv_pools("target", target_block, dtype)
    if share_mla_pool:
        draft.join_pool(target_pools[0])
        draft_pool = "target"
    for pool in target_pools:
        cache.register(pool)
    if not share_mla_pool:
        (pool,) = draft.kv_pools("draft", draft_block, dtype)
        cache.register(pool)
        draft_pool = "draft"
    cache.build()
    backend = get_backend("torch")
    runner = ModelRunner(target, cache, backend, [p.name for p in target_pools])
    requests = list(range(len(prompts)))

    def run(token_lists, position_lists, hidden):
        meta = _metadata(cache, draft_pool, requests, position_lists)
        ctx = ForwardContext(backend, cache, {draft_pool: meta})
        ids = torch.tensor([t for ts in token_lists for t in ts])
        positions = torch.tensor([p for ps in position_lists for p in ps])
        return draft(ids, positions, hidden, ctx)

    with torch.inference_mode():
        chunks_in = [Chunk(i, p) for i, p in enumerate(prompts)]
        out = runner.forward(chunks_in, draft.aux_layer_ids)
        bonus = target.compute_logits(out.hidden_states[last_token_indices(chunks_in)]).argmax(-1).tolist()
        aux = list(torch.split(out.aux_hidden_states, [len(p) for p in prompts]))
        seqs = [list(p[1:]) + [b] for p, b in zip(prompts, bonus)]
        results = [{"prefill_post": [], "prefill_next": [], "logits": [], "drafts": [], "next": []} for _ in prompts]
        bounds = [torch.linspace(0, len(s), chunks + 1).round().long().tolist() for s in seqs]
        for c in range(chunks):
            rows = [range(b[c], b[c + 1]) for b in bounds]
            hidden = torch.cat([draft.combine_aux(aux[i][r.start : r.stop]) for i, r in enumerate(rows)])
            post, nxt = run([seqs[i][r.start : r.stop] for i, r in enumerate(rows)], [list(r) for r in rows], hidden)
            lens = [len(r) for r in rows]
            for i, (p, n) in enumerate(zip(post.split(lens), nxt.split(lens))):
                results[i]["prefill_post"].append(p)
                results[i]["prefill_next"].append(n)
        for r in results:
            r["prefill_post"] = torch.cat(r["prefill_post"])
            r["prefill_next"] = torch.cat(r["prefill_next"])
        post_last = torch.stack([r["prefill_post"][-1] for r in results])
        next_last = torch.stack([r["prefill_next"][-1] for r in results])
        for step in range(k):
            logits = draft.compute_logits(post_last)
            drafts = draft.draft_to_target(logits.argmax(-1)).tolist()
            for i, r in enumerate(results):
                r["logits"].append(logits[i])
                r["drafts"].append(drafts[i])
                r["next"].append(next_last[i])
            if step + 1 < k:
                positions = [[len(s) + step] for s in seqs]
                post_last, next_last = run([[d] for d in drafts], positions, next_last)
    return seqs, aux, results


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = RTOL) -> None:
    scale = b.abs().max().clamp_min(1e-12)
    err = float((a - b).abs().max() / scale)
    assert err < rtol, f"relative error {err:.3e}"


def check_against_reference(target, spec: DraftSpec, folder, *, k=3, chunks=1, share_mla_pool=False, seed=0):
    weights = make_weights(spec, seed=seed)
    write_draft(folder, spec, weights)
    draft = load_eagle3_draft(folder, target, dtype="float64")
    seqs, aux, results = paged_chain(target, draft, PROMPTS, k, chunks=chunks, share_mla_pool=share_mla_pool)
    lm_head = target.lm_head.weight if target.lm_head is not None else target.model.embed_tokens.weight
    ref = Reference(spec, weights, target.model.embed_tokens.weight.detach(), lm_head.detach())
    for seq, a, mine in zip(seqs, aux, results):
        theirs = ref.chain(seq, a, k)
        _close(mine["prefill_post"], theirs["prefill_post"])
        _close(mine["prefill_next"], theirs["prefill_next"])
        assert mine["drafts"] == theirs["drafts"]
        for name in ("logits", "next"):
            for x, y in zip(mine[name], theirs[name]):
                _close(x, y)
    return draft, results


# ----------------------------------------------------------------------------- MHA cases
MHA_CASES = {
    # EAGLE reference: LlamaForCausalLM + draft_vocab_size, midlayer.*, default aux ids (2, 4, 5).
    "eagle-reduced-vocab": DraftSpec(layout="eagle", aux_ids=None, draft_vocab=40),
    # SpecForge 3.1 flags inside eagle_config, full vocab, no lm_head: shares the target's.
    "sglang-3.1-shared-head": DraftSpec(
        layout="sglang", fc_norm=True, norm_output=True, flags_in_eagle_config=True, own_lm_head=False
    ),
    "sglang_model-fc_norm-reduced": DraftSpec(layout="sglang_model", fc_norm=True, draft_vocab=48),
    "vllm-norm_output-norm_before_residual": DraftSpec(layout="vllm", norm_output=True, norm_before_residual=True),
    # Own embedding and a draft narrower than the target (target_hidden_size 32, hidden 24).
    "vllm_model-own-embed-narrow-norm_before_fc": DraftSpec(
        layout="vllm_model", hidden=24, head_dim=6, own_embed=True, norm_before_fc=True, draft_vocab=40
    ),
    # Reduced vocab without lm_head: the draft takes the target's lm_head rows of its vocabulary.
    "sglang-reduced-shared-head-no-t2d": DraftSpec(layout="sglang", draft_vocab=32, own_lm_head=False, with_t2d=False),
}


@pytest.mark.parametrize("case", sorted(MHA_CASES))
def test_mha_draft_matches_reference(case, llama_target, tmp_path):
    target, _ = llama_target
    check_against_reference(target, MHA_CASES[case], tmp_path / case)


def test_chunked_prefill_and_five_steps(llama_target, tmp_path):
    target, _ = llama_target
    spec = DraftSpec(layout="sglang", fc_norm=True, norm_output=True, draft_vocab=40)
    check_against_reference(target, spec, tmp_path / "d", k=5, chunks=3)


def test_norm_output_changes_what_is_fed_back(llama_target, tmp_path):
    """The same weights with and without norm_output agree on the first draft and differ after it."""
    target, _ = llama_target
    base = DraftSpec(layout="sglang", fc_norm=True)
    _, pre = check_against_reference(target, base, tmp_path / "pre")
    _, post = check_against_reference(target, attrs.evolve(base, norm_output=True), tmp_path / "post")
    _close(pre[0]["logits"][0], post[0]["logits"][0])
    assert not torch.allclose(pre[0]["next"][0], post[0]["next"][0])
    assert not torch.allclose(pre[0]["logits"][1], post[0]["logits"][1])


def test_aux_ids_are_capture_before(llama_target, tmp_path):
    """The target states the draft fuses are transformers' hidden_states[i] (id 0 = embeddings)."""
    target, hf = llama_target
    spec = DraftSpec(layout="sglang", aux_ids=(0, 3, 7))
    write_draft(tmp_path / "d", spec, make_weights(spec))
    draft = load_eagle3_draft(tmp_path / "d", target)
    _, aux, _ = paged_chain(target, draft, PROMPTS, 1)
    with torch.no_grad():
        for prompt, mine in zip(PROMPTS, aux):
            states = hf(torch.tensor([prompt]), output_hidden_states=True, use_cache=False).hidden_states
            # transformers keeps RMSNorm / RoPE tables in float32 inside a float64 model.
            _close(mine, torch.cat([states[i][0] for i in (0, 3, 7)], dim=-1), rtol=1e-6)


# ----------------------------------------------------------------------------- MLA cases
def test_mla_draft_own_pool_under_llama_target(llama_target, tmp_path):
    target, _ = llama_target
    spec = DraftSpec(layout="mla", fc_norm=True, norm_output=True, draft_vocab=40)
    draft, _ = check_against_reference(target, spec, tmp_path / "mla", chunks=2)
    assert draft.is_mla and draft.midlayer.self_attn.pool == "draft"


@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_mla_draft_in_target_mla_pool(q_lora_rank, deepseek_target, tmp_path):
    spec = DraftSpec(
        layout="mla", aux_ids=(0, 1, 2), q_lora_rank=q_lora_rank, fc_norm=q_lora_rank is None, draft_vocab=48,
        own_lm_head=q_lora_rank is not None,
    )
    draft, _ = check_against_reference(deepseek_target, spec, tmp_path / "mla", chunks=2, share_mla_pool=True)
    # The draft's latent rows are one extra layer after the target's 3 in the target's pool.
    assert (draft.midlayer.self_attn.pool, draft.midlayer.self_attn.layer_idx) == ("target", 3)
