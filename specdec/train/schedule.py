"""Learning-rate schedule and optimizer construction shared by target and draft training."""

from __future__ import annotations

import math

import torch
from torch import nn


def cosine_lr(step: int, *, total: int, peak: float, warmup: int, min_ratio: float) -> float:
    """Linear warmup to ``peak`` over ``warmup`` steps, then cosine decay to ``peak * min_ratio`` at ``total``."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with decay on matrices only: norms, biases and 1-D gains are not pulled towards zero."""
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # foreach=False: the fused multi-tensor path saves nothing on 2 CPU cores and its chunking
    # makes the update order (and rounding) depend on the parameter count.
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
