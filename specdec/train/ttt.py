"""Training-time test (EAGLE3): the attention context that lets a draft's own forward train on its own drafts.

The draft module from ``specdec.proposers.eagle3`` calls ``ctx.attend`` (MHA/GQA) or
``ctx.attend_mla`` (absorbed MLA) exactly as it does over the paged cache at serving time. This
context implements those two calls with differentiable dense attention over a batch of windows
``[B, S]``, unrolled over draft steps ``j = 0..K-1``:

- step 0 is a causal pass over every index ``p`` (the draft's prefill with the target's hidden
  states); its keys/values are kept;
- at step ``j >= 1`` the query at index ``p`` (drafting ``j`` tokens past anchor ``p``) attends to the
  step-0 keys at indices ``<= p`` plus its own chain's keys of steps ``1..j`` at index ``p``: what the
  query at position ``p + j`` sees when serving, after ``j`` draft steps from anchor ``p``.

With ``shared_kv`` (the unshifted KV-sharing draft), the step-0 keys/values at indices below each
window's ``split`` are replaced by the given target layer's: at serving time those are prompt
positions, whose KV the draft reads from the target instead of computing its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TTTContext:
    """The :class:`~specdec.models.base.AttentionContext` of one batch of ``batch x seq`` windows.

    Call :meth:`next_step` between draft steps. Tensors the draft passes in are flattened
    ``[batch * seq, ...]`` in window-major order, as the draft's varlen forward sees them. Pools are
    names only here: nothing is paged, so the members that read or write cache entries outside
    attention (what a block-sparse layer needs, never an EAGLE3 draft's) refuse.
    """

    def __init__(self, batch: int, seq: int, *, shared_kv: tuple[torch.Tensor, ...] | None = None,
                 split: torch.Tensor | None = None):
        if (shared_kv is None) != (split is None):
            raise ValueError("shared_kv and split go together: give both (KV-sharing draft) or neither")
        self.batch, self.seq = batch, seq
        self.step = 0
        self.shared_kv = shared_kv  # MHA: (k, v) each [B, kv_heads, S, D]; MLA: (latent [B, S, W],)
        self.split = split  # [B] long: indices < split[b] read the shared KV
        self._base: tuple[torch.Tensor, ...] | None = None  # step-0 keys/values
        self._chain: list[tuple[torch.Tensor, ...]] = []  # steps >= 1, one entry each (diagonal keys)

    def next_step(self) -> None:
        self.step += 1

    # ----- masks -----
    def _causal(self, device) -> torch.Tensor:
        idx = torch.arange(self.seq, device=device)
        return idx[None, :] <= idx[:, None]  # [S_q, S_k]

    def _mix_shared(self, own: torch.Tensor, shared: torch.Tensor, seq_dim: int) -> torch.Tensor:
        """Take ``shared`` at indices below each window's split, ``own`` elsewhere."""
        idx = torch.arange(self.seq, device=own.device)
        use_shared = idx[None, :] < self.split[:, None]  # [B, S]
        shape = [self.batch] + [1] * (own.ndim - 1)
        shape[seq_dim] = self.seq
        return torch.where(use_shared.view(shape), shared.to(own.dtype), own)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """``q [B, H, S, D]`` against keys ``k [B, H, S, D]`` / values ``v [B, H, S, Dv]`` -> ``[B, H, S, Dv]``."""
        if self.step == 0:
            self._base = (k, v)
            if self._chain:
                raise RuntimeError("TTTContext: step 0 ran twice; build a new context per batch")
            # A boolean mask rather than is_causal: SDPA's CPU flash path and the math path agree on it.
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self._causal(q.device), scale=scale)
        if len(self._chain) != self.step - 1:
            raise RuntimeError(f"TTTContext: attention called twice in step {self.step}; call next_step() between steps")
        self._chain.append((k, v))
        base_k, base_v = self._base
        scores = torch.matmul(q, base_k.transpose(-1, -2)) * scale  # [B, H, S, S]
        scores = scores.masked_fill(~self._causal(q.device), float("-inf"))
        diag = torch.stack([(q * ck).sum(-1) for ck, _ in self._chain], dim=-1) * scale  # [B, H, S, j]
        # Softmax in at least float32 (bf16 under autocast would lose the small weights).
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        weights = torch.softmax(torch.cat([scores, diag], dim=-1).to(work), dim=-1).to(q.dtype)
        out = torch.matmul(weights[..., : self.seq], base_v)
        for i, (_, cv) in enumerate(self._chain):
            out = out + weights[..., self.seq + i, None] * cv
        return out

    # ----- the AttentionContext calls -----
    def attend(self, pool: str, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
               scale: float, sliding_window: int | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``q [T, H, D]``, ``k``/``v [T, kv_heads, D]`` -> ``[T, H, D]`` (GQA: query head h reads kv head h // group)."""
        if sliding_window is not None:
            raise ValueError("training-time test does not support sliding-window draft attention")
        if key_mask is not None:
            raise ValueError("training-time test does not support block-sparse (key_mask) draft attention")
        B, S = self.batch, self.seq
        heads, kv_heads = q.shape[1], k.shape[1]
        qb = q.view(B, S, heads, -1).transpose(1, 2)
        kb = k.view(B, S, kv_heads, -1).transpose(1, 2)
        vb = v.view(B, S, kv_heads, -1).transpose(1, 2)
        if self.step == 0 and self.shared_kv is not None:
            shared_k, shared_v = self.shared_kv
            if tuple(shared_k.shape) != tuple(kb.shape) or tuple(shared_v.shape) != tuple(vb.shape):
                raise ValueError(
                    f"shared target KV is {tuple(shared_k.shape)}/{tuple(shared_v.shape)} but the draft's is "
                    f"{tuple(kb.shape)}/{tuple(vb.shape)} ([batch, kv_heads, seq, head_dim]); share a target layer "
                    "with the draft's kv heads and head dim"
                )
            kb, vb = self._mix_shared(kb, shared_k, 2), self._mix_shared(vb, shared_v, 2)
        group = heads // kv_heads
        kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)
        out = self._attend(qb, kb, vb, scale)
        return out.transpose(1, 2).reshape(B * S, heads, -1)

    def attend_mla(self, pool: str, layer: int, q: torch.Tensor, latent: torch.Tensor, *,
                   kv_lora_rank: int, scale: float) -> torch.Tensor:
        """Absorbed MLA: ``q [T, H, R + r]`` scores ``latent [T, R + r]``; returns ``[T, H, R]`` (attended latents)."""
        B, S = self.batch, self.seq
        heads = q.shape[1]
        qb = q.view(B, S, heads, -1).transpose(1, 2)
        lb = latent.view(B, S, -1)
        if self.step == 0 and self.shared_kv is not None:
            (shared,) = self.shared_kv
            if tuple(shared.shape) != tuple(lb.shape):
                raise ValueError(
                    f"shared target latent is {tuple(shared.shape)} but the draft's is {tuple(lb.shape)}; share an "
                    "MLA layer with the draft's kv_lora_rank + rope dims"
                )
            lb = self._mix_shared(lb, shared, 1)
        # One latent "head" serves every query head: expand (a view) rather than copy.
        kb = lb[:, None].expand(B, heads, S, lb.shape[-1])
        vb = kb[..., :kv_lora_rank]
        out = self._attend(qb, kb, vb, scale)
        return out.transpose(1, 2).reshape(B * S, heads, kv_lora_rank)

    def write(self, pool: str, layer: int, entries) -> None:
        """Refuses: training-time test keeps only what :meth:`attend` / :meth:`attend_mla` are given."""
        raise NotImplementedError(self._no_cache("write"))

    def gather(self, pool: str, layer: int, entry: str) -> torch.Tensor:
        """Refuses, as :meth:`write` does."""
        raise NotImplementedError(self._no_cache("gather"))

    def pool_metadata(self, pool: str):
        """Refuses, as :meth:`write` does: the windows have no paged layout."""
        raise NotImplementedError(self._no_cache("pool_metadata"))

    @staticmethod
    def _no_cache(member: str) -> str:
        return (f"TTTContext.{member}: training-time test runs draft layers that only attend (attend / attend_mla); "
                "a layer that reads or writes its own cache entries (block-sparse attention) cannot be trained here")
