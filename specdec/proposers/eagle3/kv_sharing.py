"""KV sharing for unshifted EAGLE3 drafts: which target layer the draft reads, and the attention that does.

An unshifted draft puts token ``p`` at position ``p``, like the target, so at prompt positions it can
use a target layer's cached K/V (or MLA latent) instead of computing its own (FACTS.md section 4;
vLLM's ``kv_sharing_target_layer_name``, SGLang's frozen-KV MTP). Its queries then attend over two
disjoint key sets: the target layer's rows at positions ``[0, P)`` (``P`` = the prompt length), read
non-causally from the target's pool, and its own rows at positions ``>= P``, causal in its own pool.
The two partial results merge exactly by their log-sum-exp (:func:`merge_attention_states`).

The mapping is ``{draft layer: target layer}``; EAGLE3 drafts have one layer, so it is one target
layer index. Layouts must match exactly: MHA/GQA (kv heads, head dim and value head dim) or MLA
(kv_lora_rank and rope dims); anything else is refused with the layouts named.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch

from specdec.backends.base import AttentionMetadata
from specdec.backends.merge import merge_attention_states
from specdec.cache.pool import PagedPool
from specdec.models.base import ForwardContext, kv_scales


@attrs.frozen
class SharedLayer:
    """Draft layer ``draft_layer`` reads target layer ``target_layer``, stored as layer ``pool_layer`` of ``pool``."""

    draft_layer: int
    target_layer: int
    pool: str
    pool_layer: int


@attrs.frozen
class KVSource:
    """Keys to attend over without writing: layer ``layer`` of pool ``pool``, described by ``metadata``."""

    pool: str
    layer: int
    metadata: AttentionMetadata


def pool_layout(pool: PagedPool) -> tuple | None:
    """The KV layout a pool layer holds: ``("attention", kv_heads, head_dim, v_head_dim)``,
    ``("mla", kv_lora_rank, rope_dim)``, or None for layouts a draft cannot read (indexer keys, ...)."""
    if pool.kind == "attention":
        return ("attention", pool.num_kv_heads, pool.head_dim, pool.v_head_dim)
    if pool.kind == "mla":
        return ("mla", pool.kv_lora_rank, pool.qk_rope_head_dim)
    return None


def draft_layout(draft) -> tuple:
    """The layout of the draft's own KV, in :func:`pool_layout`'s terms."""
    if draft.is_mla:
        return ("mla", draft.kv_lora_rank, draft.qk_rope_head_dim)
    attn = draft.midlayer.self_attn
    return ("attention", attn.num_kv_heads, attn.head_dim, attn.head_dim)


def describe_layout(layout: tuple | None) -> str:
    if layout is None:
        return "no K/V a draft can read"
    if layout[0] == "attention":
        _, heads, dim, vdim = layout
        return f"MHA/GQA K/V of {heads} kv heads x head_dim {dim}" + (f" (values {vdim})" if vdim != dim else "")
    return f"an MLA latent of kv_lora_rank {layout[1]} + rope {layout[2]}"


def choose_shared_layer(
    layouts: Sequence[tuple | None], want: tuple, *, requested: int | None = None, declared: int | None = None
) -> int:
    """The rule for which target layer a KV-sharing draft reads, for serving and training alike.

    ``layouts[i]`` is target layer ``i``'s KV layout (:func:`pool_layout`'s terms), ``want`` the draft's.
    The layer is ``requested`` (the speculative config's ``kv_sharing_target_layer``), else ``declared``
    (the draft config's, what it was trained with), else the last layer whose layout matches. Raises
    ValueError naming the layouts when the chosen layer's differs, or when none matches.
    """
    chosen, source = requested, "kv_sharing_target_layer"
    if chosen is None:
        chosen, source = declared, "the draft config's eagle_config.kv_sharing_target_layers"
    matching = [i for i, layout in enumerate(layouts) if layout == want]
    if chosen is None:
        if not matching:
            found = sorted({describe_layout(layout) for layout in layouts})
            raise ValueError(
                f"KV sharing: no target layer holds KV the draft can read: the draft's layer has "
                f"{describe_layout(want)}, the target's layers have {'; '.join(found)}; set kv_sharing=false"
            )
        return matching[-1]
    if not 0 <= chosen < len(layouts):
        raise ValueError(
            f"KV sharing: {source} is {chosen} but the target has layers 0..{len(layouts) - 1}; pick one of those"
        )
    if layouts[chosen] != want:
        hint = (f"layers with the draft's layout: {matching}" if matching
                else "no target layer has it; set kv_sharing=false")
        raise ValueError(
            f"KV sharing: target layer {chosen} ({source}) keeps {describe_layout(layouts[chosen])}, but the "
            f"draft's layer has {describe_layout(want)}; the KV layouts must match ({hint})"
        )
    return chosen


def resolve_shared_layer(
    target,
    target_pools: Sequence[PagedPool],
    draft,
    *,
    requested: int | None = None,
    declared: int | None = None,
) -> SharedLayer:
    """The target layer (and its pool layer) the draft's layer 0 reads, by :func:`choose_shared_layer`."""
    slots = target.kv_layer_slots()
    pools = {p.name: p for p in target_pools}
    layouts = [pool_layout(pools[name]) if name in pools else None for name, _ in slots]
    chosen = choose_shared_layer(layouts, draft_layout(draft), requested=requested, declared=declared)
    pool, pool_layer = slots[chosen]
    return SharedLayer(draft_layer=0, target_layer=chosen, pool=pool, pool_layer=pool_layer)


def prefix_metadata(
    block_tables: torch.Tensor, prefix_lens: Sequence[int], query_lens: Sequence[int], block_size: int
) -> AttentionMetadata:
    """Non-causal metadata over each request's first ``prefix_lens[i]`` positions of a pool; writes nothing."""
    num_tokens = sum(query_lens)
    return AttentionMetadata.build(
        query_lens=list(query_lens),
        seq_lens=list(prefix_lens),
        block_tables=block_tables,
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=block_tables.device),
        block_size=block_size,
        causal=False,
    )


@attrs.define
class SharedKVContext(ForwardContext):
    """A :class:`ForwardContext` in which some layers also attend over another pool's keys.

    ``shared[(pool, layer)]`` names the extra source of the layer bound to ``(pool, layer)``: that
    layer's new K/V (or latent) is written to its own pool and attended causally there as usual,
    its queries also attend over the source without writing, and the two merge by LSE. ``write``,
    ``gather`` and ``pool_metadata`` act on the named pool alone, as in any forward.
    """

    shared: dict[tuple[str, int], KVSource] = attrs.field(factory=dict)

    def attend(self, pool, layer, q, k, v, *, scale, sliding_window=None, key_mask=None):
        source = self.shared.get((pool, layer))
        if source is None:
            return super().attend(pool, layer, q, k, v, scale=scale, sliding_window=sliding_window, key_mask=key_mask)
        if sliding_window is not None:
            raise ValueError("KV sharing does not support sliding-window draft attention")
        if key_mask is not None:
            raise ValueError("KV sharing does not support block-sparse (key_mask) draft attention")
        self.write(pool, layer, {"k": k, "v": v})
        own_pool, src_pool, meta = self.cache.pool(pool), self.cache.pool(source.pool), self.metadata[pool]
        kv, src = own_pool.layer(layer), src_pool.layer(source.layer)
        own, own_lse = self.backend.attention(q, kv["k"], kv["v"], meta, scale=scale, return_lse=True,
                                              **kv_scales(own_pool, layer, "k", "v"))
        shared, shared_lse = self.backend.attention(
            q, src["k"], src["v"], source.metadata, scale=scale, return_lse=True,
            **kv_scales(src_pool, source.layer, "k", "v"),
        )
        return merge_attention_states(shared, shared_lse, own, own_lse)

    def attend_mla(self, pool, layer, q, latent, *, kv_lora_rank, scale):
        source = self.shared.get((pool, layer))
        if source is None:
            return super().attend_mla(pool, layer, q, latent, kv_lora_rank=kv_lora_rank, scale=scale)
        self.write(pool, layer, {"latent": latent})
        own_pool, src_pool, meta = self.cache.pool(pool), self.cache.pool(source.pool), self.metadata[pool]
        own, own_lse = self.backend.mla_attention(
            q, own_pool.layer(layer)["latent"], meta, kv_lora_rank=kv_lora_rank, scale=scale, return_lse=True,
            **kv_scales(own_pool, layer, "latent"),
        )
        shared, shared_lse = self.backend.mla_attention(
            q, src_pool.layer(source.layer)["latent"], source.metadata, kv_lora_rank=kv_lora_rank, scale=scale,
            return_lse=True, **kv_scales(src_pool, source.layer, "latent"),
        )
        return merge_attention_states(shared, shared_lse, own, own_lse)
