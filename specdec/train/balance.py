"""Auxiliary-loss-free expert balancing (DeepSeek-V3) for MoE targets trained with transformers.

transformers' DeepSeek-V3 and MiniMax-M3 routers add a per-expert ``e_score_correction_bias``
to the scores used for top-k selection but never update it. Without balancing, a tiny MoE
collapses onto one or two experts. After every optimizer step each router's bias moves by
``rate`` towards under-used experts: ``bias += rate * sign(mean_load - load)``.
"""

from __future__ import annotations

import torch
from torch import nn


class RouterBalancer:
    """Counts the experts each router picks during forwards and nudges its selection bias."""

    def __init__(self, model: nn.Module, rate: float):
        self.rate = rate
        self.routers: list[nn.Module] = [
            m for m in model.modules() if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)
        ]
        self._counts: dict[int, torch.Tensor] = {}
        self._handles = [r.register_forward_hook(self._record) for r in self.routers]

    def _record(self, module: nn.Module, inputs, output) -> None:
        # Both routers return (router_logits, top_k_weights, top_k_index).
        top_k_index = output[2]
        num_experts = module.e_score_correction_bias.numel()
        counts = torch.bincount(top_k_index.reshape(-1), minlength=num_experts).to(torch.float32)
        key = id(module)
        self._counts[key] = self._counts.get(key, 0) + counts

    def step(self) -> float:
        """Apply the bias update from the loads seen since the last call; returns the worst max/mean load."""
        worst = 1.0
        with torch.no_grad():
            for router in self.routers:
                counts = self._counts.get(id(router))
                if counts is None or counts.sum() == 0:
                    continue
                mean = counts.mean()
                router.e_score_correction_bias.add_(self.rate * torch.sign(mean - counts))
                worst = max(worst, float(counts.max() / mean))
        self._counts.clear()
        return worst

    def discard(self) -> None:
        """Forget loads recorded outside training (e.g. by evaluation forwards)."""
        self._counts.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
