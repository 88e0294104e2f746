"""The models' protocols, each held to every member it declares by every built-in:

- ``CausalLM``: every target architecture, loaded from the tiny checkpoints (MiniMax-M3 from its
  tiny config); ``PagedModel`` (what cache set-up reads) also: the EAGLE3 draft heads;
- ``AttentionContext``: the paged ``ForwardContext``, KV sharing's ``SharedKVContext`` and the
  training-time test's ``TTTContext``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from protocol_members import conformance_problems, protocol_members, without
from specdec.backends import get_backend
from specdec.backends.base import AttentionMetadata
from specdec.cache import PagedKVCache, PagedPool
from specdec.models import load_model, supported_model_types
from specdec.models.base import AttentionContext, CausalLM, ForwardContext, PagedModel
from specdec.models.minimax_m3 import MiniMaxM3ForCausalLM
from specdec.models.registry import model_class
from specdec.proposers.eagle3.config import Eagle3DraftConfig
from specdec.proposers.eagle3.kv_sharing import SharedKVContext
from specdec.proposers.eagle3.mla_model import Eagle3MLADraft
from specdec.proposers.eagle3.model import Eagle3LlamaDraft
from specdec.train.ttt import TTTContext
from test_minimax_m3 import tiny_text_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proposers"))
from eagle3_reference import DraftSpec, draft_config  # noqa: E402

CHECKPOINTS = ("llama", "qwen3", "deepseek_v3", "minimax_m2")


@pytest.fixture(scope="module", params=[*CHECKPOINTS, "minimax_m3"])
def target(request, tiny_checkpoint):
    if request.param == "minimax_m3":
        with torch.device("meta"):  # only its members are checked here
            return MiniMaxM3ForCausalLM(tiny_text_config())
    return load_model(tiny_checkpoint(request.param), dtype="float64")


def test_target_implements_every_member(target):
    assert conformance_problems(target, CausalLM) == []
    assert isinstance(target, CausalLM)


def test_target_members_describe_the_model(target):
    assert target.output_weight().shape == (target.vocab_size, target.hidden_size)
    pools = target.kv_pools("target", target.required_block_size or 16, torch.float64)
    slots = target.kv_layer_slots()
    layers = {p.name: p.num_layers for p in pools}
    assert len(slots) == target.num_layers
    assert all(pool in layers and 0 <= index < layers[pool] for pool, index in slots)
    assert next(target.parameters()).dtype in (torch.float32, torch.float64)


@pytest.mark.parametrize("cls", sorted(
    {*(model_class(SimpleNamespace(model_type=t)) for t in supported_model_types()), Eagle3LlamaDraft, Eagle3MLADraft},
    key=lambda c: c.__name__,
), ids=lambda c: c.__name__)
def test_paged_model_data_members_are_declared_on_every_class(cls):
    # Present before any instance exists, so no caller needs getattr(model, name, default).
    for name in ("required_block_size", "needs_custom_mask"):
        assert name in dir(cls), name


@pytest.mark.parametrize("member", sorted(protocol_members(CausalLM)))
def test_a_target_lacking_any_member_fails_the_check(member, tiny_checkpoint):
    model = load_model(tiny_checkpoint("llama"), dtype="float64")
    assert conformance_problems(without(model, CausalLM, member), CausalLM) == [f"{member} is missing"]


@pytest.mark.parametrize("spec", [DraftSpec(), DraftSpec(layout="mla")], ids=["mha", "mla"])
def test_draft_head_implements_paged_model(spec):
    config = Eagle3DraftConfig.from_dict(draft_config(spec))
    cls = Eagle3MLADraft if spec.is_mla else Eagle3LlamaDraft
    draft = cls(config, aux_layer_ids=(0, 1, 2), target_hidden_size=spec.target_hidden, own_embedding=True,
                own_lm_head=True)
    assert conformance_problems(draft, PagedModel) == []
    (pool,) = draft.kv_pools("draft", 4, torch.float32)
    assert pool.kind == ("mla" if spec.is_mla else "attention") and pool.num_layers == 1
    assert (draft.midlayer.self_attn.pool, draft.midlayer.self_attn.layer_idx) == ("draft", 0)


# ----------------------------------------------------------------------------- attention contexts


def _paged(context_cls, **kwargs):
    """A context over one built 2-layer pool of 4-token pages, for two requests of 5 and 2 new tokens."""
    cache = PagedKVCache(1 << 16)
    cache.register(PagedPool("index", num_layers=2, block_size=4, dtype=torch.float64, entries={"k": (3,)}))
    cache.build()
    slots = [cache.append_slots(r, n)["index"] for r, n in ((0, 5), (1, 2))]
    meta = AttentionMetadata.build(
        query_lens=[5, 2], seq_lens=[5, 2], block_tables=cache.block_tables([0, 1], "index"),
        slot_mapping=torch.cat(slots), block_size=4,
    )
    return context_cls(get_backend("torch"), cache, {"index": meta}, **kwargs)


def built_in_contexts() -> list[AttentionContext]:
    return [_paged(ForwardContext), _paged(SharedKVContext, shared={}), TTTContext(1, 4)]


@pytest.mark.parametrize("ctx", built_in_contexts(), ids=lambda c: type(c).__name__)
def test_context_implements_every_member(ctx):
    assert conformance_problems(ctx, AttentionContext) == []
    assert isinstance(ctx, AttentionContext)


@pytest.mark.parametrize("member", sorted(protocol_members(AttentionContext)))
def test_a_context_lacking_any_member_fails_the_check(member):
    ctx = built_in_contexts()[0]
    assert conformance_problems(without(ctx, AttentionContext, member), AttentionContext) == [
        f"{member} is missing"
    ]


@pytest.mark.parametrize("context_cls", [ForwardContext, SharedKVContext])
def test_paged_context_gathers_back_what_it_wrote(context_cls):
    ctx = _paged(context_cls)
    keys = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ctx.write("index", 1, {"k": keys})
    gathered = ctx.gather("index", 1, "k")
    assert ctx.pool_metadata("index") is ctx.metadata["index"]
    assert gathered.shape == (2, 5, 3)
    assert torch.equal(gathered[0], keys[:5]) and torch.equal(gathered[1, :2], keys[5:])
    assert not ctx.cache.pool("index").layer(0)["k"].any()  # other layers untouched


def test_training_context_refuses_cache_reads_and_block_sparse_attention():
    ctx = TTTContext(1, 4)
    for call in (lambda: ctx.write("p", 0, {}), lambda: ctx.gather("p", 0, "k"), lambda: ctx.pool_metadata("p")):
        with pytest.raises(NotImplementedError, match="only attend"):
            call()
    q, kv = torch.zeros(4, 2, 8), torch.zeros(4, 1, 8)
    with pytest.raises(ValueError, match="block-sparse"):
        ctx.attend("p", 0, q, kv, kv, scale=0.3, key_mask=torch.ones(4, 1, 4, dtype=torch.bool))
