"""Temperature / top-k / top-p: the one place logits become the distribution tokens are drawn from.

The non-speculative sampler, the rejection verifier (for p) and sampling drafters (for q) all call
``target_probs`` so that every distribution in the system is processed identically; losslessness
of speculative sampling depends on it.
"""

from __future__ import annotations

import torch


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    # float64 stays float64 (exactness tests); everything narrower is lifted to float32.
    return torch.float64 if dtype == torch.float64 else torch.float32


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of ``logits [..., V]`` (the first on ties), int64.

    Half-precision rows are lifted to float32 first: the same answer (the cast is exact), and CPU's
    half-precision argmax is several times slower than float32's.
    """
    return logits.to(work_dtype(logits.dtype)).argmax(dim=-1)


def _filter_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits outside each row's top-k, then outside its top-p nucleus."""
    vocab = x.shape[-1]
    # Stable sort: equal logits keep index order, so the nucleus boundary is deterministic.
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)

    use_k = (top_k > 0) & (top_k < vocab)
    if bool(use_k.any()):
        k = torch.where(use_k, top_k, vocab).clamp(1, vocab)
        kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
        # Values tied with the k-th are kept: which of equal logits to drop has no good answer.
        sorted_x = torch.where(sorted_x < kth, neg_inf, sorted_x)

    use_p = top_p < 1
    if bool(use_p.any()):
        mass = torch.softmax(sorted_x, dim=-1)
        before = mass.cumsum(dim=-1) - mass  # mass strictly ahead of each token
        drop = before >= top_p.to(x.dtype).unsqueeze(1)
        drop[:, 0] = False  # the most likely token always survives
        # Rows with top_p == 1 must not lose tail tokens to cumsum rounding reaching 1.0 early.
        drop &= use_p.unsqueeze(1)
        sorted_x = torch.where(drop, neg_inf, sorted_x)

    return torch.empty_like(x).scatter_(1, order, sorted_x)


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Per-row sampling distributions ``[N, V]`` from ``logits [N, V]`` and per-row parameters.

    ``temperature [N]`` (0 = greedy), ``top_k [N]`` int (0 = off), ``top_p [N]`` (1 = off).
    Order: divide by temperature, keep top-k, keep the top-p nucleus, softmax. Greedy rows are the
    one-hot of ``argmax(logits)`` (first index among ties). Rows sum to 1; float64 input gives
    float64 output, any other dtype gives float32.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n = logits.shape[0]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if t.shape != (n,):
            raise ValueError(f"{name} must have shape [{n}] (one per logits row), got {tuple(t.shape)}")

    dtype = work_dtype(logits.dtype)
    greedy = temperature <= 0
    x = logits.to(dtype)
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).to(dtype)
    x = x / scale.unsqueeze(1)

    needs_filter = ((top_k > 0) & (top_k < logits.shape[1])) | (top_p < 1)
    needs_filter &= ~greedy  # argmax is unchanged by top-k/top-p
    if bool(needs_filter.any()):
        rows = needs_filter.nonzero().squeeze(1)
        x[rows] = _filter_top_k_top_p(x[rows], top_k[rows], top_p[rows])

    probs = torch.softmax(x, dim=-1)
    if bool(greedy.any()):
        rows = greedy.nonzero().squeeze(1)
        one_hot = torch.zeros(rows.numel(), logits.shape[1], dtype=dtype, device=logits.device)
        one_hot.scatter_(1, logits[rows].argmax(dim=-1, keepdim=True), 1.0)
        probs[rows] = one_hot
    return probs
