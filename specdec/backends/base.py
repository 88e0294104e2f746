"""The attention-backend protocol and the metadata every backend consumes."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Hashable, Mapping, Protocol, Sequence, runtime_checkable

import attrs
import torch


@attrs.frozen
class AttentionMetadata:
    """Where one forward's queries sit and where their KV lives, for one pool.

    The batch is varlen: request ``i`` contributes ``query_lens[i]`` query tokens, which are the
    *last* ``query_lens[i]`` of its ``seq_lens[i]`` cached tokens (their KV is written before
    attention). Prefill (``query_len == seq_len``), chunked prefill, decode (1 query) and verify (k+1
    queries) are all this one shape. With ``causal``, query ``j`` of request ``i`` sees keys at
    positions ``<= seq_lens[i] - query_lens[i] + j``.

    One forward may attend over several pools, each with its own metadata (KV sharing: the target
    pool's prompt pages, then the draft pool's own pages). A pool that holds only keys *before* the
    queries is read with ``causal=False`` and may have fewer keys than queries; a request with no keys
    in a pool (``seq_len 0``) is allowed either way, and its queries see nothing there.
    """

    query_start_loc: torch.Tensor  # int32 [B + 1], cumulative query lengths
    seq_lens: torch.Tensor  # int32 [B], KV length per request including this step's tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks], physical block of each logical block
    slot_mapping: torch.Tensor  # int64 [T], slot (block * block_size + offset) of each new token's KV
    block_size: int
    max_query_len: int
    max_seq_len: int
    causal: bool = True
    # The shortest seq_len (0 when unknown): with max_seq_len it tells a backend when no request is short.
    min_seq_len: int = 0
    # Optional [T, max_seq_len] bool mask (True = may attend), for tree drafts; ANDed with causality.
    custom_mask: torch.Tensor | None = None
    # Index tensors derived from the layout, shared by every layer of the forward and by copies made
    # with attrs.evolve (a per-head-group custom_mask): see :meth:`derived`.
    _derived: dict = attrs.field(factory=dict, eq=False, repr=False, kw_only=True)

    @classmethod
    def build(
        cls,
        *,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_size: int,
        causal: bool = True,
        custom_mask: torch.Tensor | None = None,
    ) -> "AttentionMetadata":
        device = block_tables.device
        if len(query_lens) != len(seq_lens):
            raise ValueError("query_lens and seq_lens must have one entry per request")
        if causal and any(0 < s < q for q, s in zip(query_lens, seq_lens)):
            raise ValueError(
                "a request cannot have more queries than cached tokens in a causal pool (its queries' own KV "
                "is written first); use causal=False for a pool that holds only keys before the queries"
            )
        if any(q < 0 or s < 0 for q, s in zip(query_lens, seq_lens)):
            raise ValueError("query_lens and seq_lens must be >= 0")
        return cls(
            query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device),
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            block_size=block_size,
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            causal=causal,
            min_seq_len=min(seq_lens, default=0),
            custom_mask=custom_mask,
        )

    @property
    def num_requests(self) -> int:
        return self.seq_lens.numel()

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def num_query_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def derived(self, name: Hashable, compute: Callable[["AttentionMetadata"], Any]) -> Any:
        """``compute(self)`` for a value that depends only on the query/sequence layout and the block
        tables, computed once.

        Every layer of a forward reads the same metadata, so per-token indices, key slots and causal
        masks are built once instead of once per layer. An entry is reused only by metadata with the
        very ``query_start_loc`` / ``seq_lens`` / ``block_tables`` tensors (and lengths, causality) it was
        computed from, so an evolved copy with another layout recomputes; ``custom_mask`` must not
        enter ``compute``.
        """
        layout = (self.query_start_loc, self.seq_lens, self.block_tables, self.max_query_len, self.max_seq_len,
                  self.causal)
        hit = self._derived.get(name)
        if hit is not None and all(a is b for a, b in zip(hit[0][:3], layout[:3])) and hit[0][3:] == layout[3:]:
            return hit[1]
        value = compute(self)
        self._derived[name] = (layout, value)
        return value


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a backend's log-sum-exp output for queries of ``dtype``: float32, or float64 for
    float64 queries (a float32 LSE would cost float64 runs their exactness when partials merge)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# Half types oneDNN has kernels for on this CPU, by torch's own probes (bf16 wants AVX-512 or
# AVX-NE-CONVERT). Elsewhere, as on an AVX2-only EPYC, torch's half GEMMs are scalar fallbacks, 3-4x
# slower than float32's at 8 rows, and its half attention 1.5-2x slower than converting to float32 first.
_NATIVE_HALF = frozenset(
    dtype
    for dtype, probe in ((torch.bfloat16, "_is_mkldnn_bf16_supported"), (torch.float16, "_is_mkldnn_fp16_supported"))
    if torch.backends.mkldnn.is_available() and getattr(torch.ops.mkldnn, probe)()
)


def math_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype to run ``dtype``'s GEMMs and attention in on ``device``: float32 for a half type the CPU
    has no kernels for, else ``dtype`` itself.

    Nothing is lost by the detour: a product of two half values is exact in float32, and half kernels
    accumulate in float32 too, so the result is the half type's up to summation order once rounded
    back (which callers do where the half kernel would round: on the way out)."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and dtype not in _NATIVE_HALF:
        return torch.float32
    return dtype


# What ``attention`` / ``mla_attention`` return: ``out``, or ``(out, lse)`` with ``return_lse``.
AttentionOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@runtime_checkable
class AttentionBackend(Protocol):
    """Reads and writes KV in pool pages and computes paged attention over them.

    Shapes: ``q [T, num_heads, head_dim]``; a pool layer's ``k`` ``[num_blocks, block_size, kv_heads,
    head_dim]`` and ``v`` ``[num_blocks, block_size, kv_heads, v_head_dim]``; MLA latent ``[num_blocks,
    block_size, kv_lora_rank + rope_dim]``; any other entry ``[num_blocks, block_size, *entry_shape]``.
    Attention is always the varlen paged shape of :class:`AttentionMetadata`.
    """

    # The name ``get_backend`` selects it by, quoted in error messages.
    name: str
    # Whether ``attention`` honours ``AttentionMetadata.custom_mask`` (block-sparse or tree attention).
    supports_custom_mask: bool

    def supports_block_size(self, block_size: int, pool_kind: str) -> bool:
        """Whether this backend can run a pool of kind ``"attention"`` / ``"mla"`` at this page size."""
        ...

    def supports_kv_dtype(self, dtype: torch.dtype, pool_kind: str) -> bool:
        """Whether this backend reads a pool of kind ``pool_kind`` storing ``dtype`` (fp8 pools: see
        :mod:`specdec.cache.quant`; an engine refuses an fp8 pool its backend cannot read)."""
        ...

    def write_kv(
        self, layer: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor], slot_mapping: torch.Tensor
    ) -> None:
        """Store ``values[entry]`` (``[T, *entry_shape]``) at ``slot_mapping`` in ``layer[entry]``."""
        ...

    def gather_pages(self, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Each request's first ``meta.max_seq_len`` cached tokens of one entry ``cache``, ``[B,
        max_seq_len, *entry_shape]`` (rows past a request's ``seq_len`` hold whatever its pages do).

        For a model that reads an entry itself (MiniMax-M3's indexer keys) rather than attending over it.
        """
        ...

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        return_lse: bool = False,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> AttentionOutput:
        """Paged (GQA) attention; returns ``[T, num_heads, v_head_dim]``. ``k_scale`` / ``v_scale`` come
        with fp8 pools: a stored value times its scale is the key or value (:mod:`specdec.cache.quant`).

        With ``return_lse`` it returns ``(out, lse)``: ``lse [T, num_heads]`` is the log-sum-exp of
        the scaled scores over the keys each query saw (``-inf`` where it saw none, with ``out`` 0
        there), float32, or float64 when ``q`` is float64 so that exact runs stay exact. Partial
        results over disjoint key sets combine with :func:`specdec.backends.merge.merge_attention_states`.
        """
        ...

    def mla_attention(
        self,
        q: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        kv_lora_rank: int,
        scale: float,
        return_lse: bool = False,
        latent_scale: float | None = None,
    ) -> AttentionOutput:
        """Absorbed MLA: ``q [T, H, kv_lora_rank + rope_dim]`` against the latent cache (keys: the whole
        latent, values: its first ``kv_lora_rank`` columns); returns ``[T, H, kv_lora_rank]``, or
        ``(out, lse)`` with ``return_lse`` (``lse [T, H]`` as in :meth:`attention`)."""
        ...
