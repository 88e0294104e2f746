"""The ``eagle3-unshifted`` proposer's configuration, in float64: which target layer the shared
draft layer reads (the speculative config, then the checkpoint's ``eagle_config``, then the default),
the refusals that name their fix, the engine's page-size check on the shared pool, and cache sequences
that start past the prompt. Models and reference: unshifted_harness.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_oracle import write_oracle_draft
from eagle3_reference import DraftSpec, make_weights, write_draft
from unshifted_harness import (
    BLOCK,
    GREEDY,
    MEMORY,
    PROMPTS,
    SPECS,
    make_llm,
    record,
    setup,
    ref_drafts,
    spec_config,
    target_states,
)

from specdec import LLM
from specdec.cache import PagedKVCache
from specdec.proposers.config import parse_speculative_config
from specdec.proposers.eagle3.unshifted import UnshiftedEagle3Proposer
from specdec.proposers.registry import create_proposer


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
