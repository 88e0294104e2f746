"""Sampling: parameters, the shared logits processing, counter-based RNG and the batch sampler."""

from specdec.sampling.params import SamplingParams
from specdec.sampling.processing import greedy_ids, target_probs
from specdec.sampling.random import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_RESIDUAL,
    STREAM_SAMPLE,
    categorical,
    uniform,
)
from specdec.sampling.sampler import Sampler, SamplingBatch

__all__ = [
    "STREAM_ACCEPT",
    "STREAM_DRAFT",
    "STREAM_RESIDUAL",
    "STREAM_SAMPLE",
    "Sampler",
    "SamplingBatch",
    "SamplingParams",
    "categorical",
    "greedy_ids",
    "target_probs",
    "uniform",
]
