"""Batched, seeded sampling of one token per row."""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import torch

from specdec.sampling.params import SamplingParams
from specdec.sampling.processing import greedy_ids, target_probs
from specdec.sampling.random import STREAM_SAMPLE, categorical, to_int64_seed


def _vector(dtype: torch.dtype):
    def check(inst: Any, attr: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype != dtype:
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise ValueError(f"SamplingBatch.{attr.name} must be a 1-D {dtype} tensor, got {got}")

    return check


@attrs.frozen
class SamplingBatch:
    """Per-row sampling parameters as tensors, built once per step.

    ``counters[i]`` is the position (index in prompt + output) of the token row ``i`` decides; the
    random numbers for that token are keyed by (seed, position, stream), which is what makes a
    seeded request independent of batch composition and row order. For a verifier, ``counters[b]``
    is the position of request b's first draft (= its first token emitted this step).
    """

    temperature: torch.Tensor = attrs.field(validator=_vector(torch.float64))
    top_k: torch.Tensor = attrs.field(validator=_vector(torch.int64))
    top_p: torch.Tensor = attrs.field(validator=_vector(torch.float64))
    seeds: torch.Tensor = attrs.field(validator=_vector(torch.int64))
    counters: torch.Tensor = attrs.field(validator=_vector(torch.int64))

    def __attrs_post_init__(self) -> None:
        n = self.temperature.shape[0]
        for name in ("top_k", "top_p", "seeds", "counters"):
            rows = getattr(self, name).shape[0]
            if rows != n:
                raise ValueError(f"SamplingBatch.{name} has {rows} rows but temperature has {n}; give one per row")

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        positions: Sequence[int] | torch.Tensor,
        default_seeds: Sequence[int] | None = None,
        device: torch.device | str | None = None,
    ) -> "SamplingBatch":
        """One row per request: ``params[i]`` sampling the token at ``positions[i]``.

        A request's own ``seed`` wins. Requests without one use ``default_seeds[i]``: the engine
        assigns each request a seed once, at admission (e.g. from ``LLM(seed=...)`` and the
        request's index), and passes the same value every step. A sampling (temperature > 0) row
        with neither is an error, since silently sharing a seed would correlate requests.
        """
        n = len(params)
        if len(positions) != n:
            raise ValueError(f"positions has {len(positions)} entries for {n} requests; pass one per request")
        if default_seeds is not None and len(default_seeds) != n:
            raise ValueError(f"default_seeds has {len(default_seeds)} entries for {n} requests; pass one per request")
        seeds: list[int] = []
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"params[{i}] must be a SamplingParams, got {type(sp).__name__}")
            if sp.seed is not None:
                seeds.append(to_int64_seed(sp.seed))
            elif default_seeds is not None:
                seeds.append(to_int64_seed(int(default_seeds[i])))
            elif sp.greedy:
                seeds.append(0)  # never used: greedy rows draw no random numbers
            else:
                raise ValueError(
                    f"request {i} samples (temperature={sp.temperature}) without a seed; "
                    "pass default_seeds= (the engine assigns one per request)"
                )
        counters = torch.as_tensor(positions, dtype=torch.int64, device=device)
        return cls(
            temperature=torch.tensor([sp.temperature for sp in params], dtype=torch.float64, device=device),
            top_k=torch.tensor([sp.top_k for sp in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([sp.top_p for sp in params], dtype=torch.float64, device=device),
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            counters=counters.reshape(-1).clone(),
        )

    @classmethod
    def for_sequences(cls, seqs: Sequence, device: torch.device | str | None = None) -> "SamplingBatch":
        """One row per engine sequence: its params and seed, sampling the token after its last one."""
        return cls.from_params(
            [s.params for s in seqs], [s.num_tokens for s in seqs], [s.seed for s in seqs], device=device
        )

    def __len__(self) -> int:
        return int(self.temperature.shape[0])

    @property
    def greedy(self) -> torch.Tensor:
        """bool [N]: rows decided by argmax."""
        return self.temperature <= 0

    def select(self, index: torch.Tensor) -> "SamplingBatch":
        """The rows at ``index`` (int64 indices or a bool mask), in that order."""
        return SamplingBatch(
            temperature=self.temperature[index],
            top_k=self.top_k[index],
            top_p=self.top_p[index],
            seeds=self.seeds[index],
            counters=self.counters[index],
        )

    def expand(self, num_rows: torch.Tensor) -> "SamplingBatch":
        """Row b repeated ``num_rows[b]`` times with counters ``counters[b] + 0, 1, ...``.

        Turns a per-request batch into a per-token one, e.g. ``expand(num_drafts + 1)`` gives the
        parameters of every verify row, flattened request-major.
        """
        num_rows = torch.as_tensor(num_rows, dtype=torch.int64, device=self.counters.device)
        if num_rows.shape != self.counters.shape or bool((num_rows < 0).any()):
            raise ValueError(f"num_rows must be [{len(self)}] non-negative ints, got {num_rows.tolist()}")
        rep = lambda t: t.repeat_interleave(num_rows)  # noqa: E731
        starts = torch.cumsum(num_rows, 0) - num_rows
        offset = torch.arange(int(num_rows.sum()), device=num_rows.device) - rep(starts)
        return SamplingBatch(
            temperature=rep(self.temperature),
            top_k=rep(self.top_k),
            top_p=rep(self.top_p),
            seeds=rep(self.seeds),
            counters=rep(self.counters) + offset,
        )


class Sampler:
    """Draws one token per logits row: argmax for greedy rows, a seeded exact draw otherwise."""

    def sample(self, logits: torch.Tensor, batch: SamplingBatch | None) -> torch.Tensor:
        """Token ids int64 ``[N]`` for ``logits [N, V]``; the distribution is ``target_probs``. Without a
        ``batch`` every row is greedy (the engine builds none for an all-greedy step)."""
        num_rows = logits.shape[0] if batch is None else len(batch)
        if logits.dim() != 2 or logits.shape[0] != num_rows:
            raise ValueError(
                f"logits must be [N, V] with N = {num_rows} (the batch's rows), got {tuple(logits.shape)}"
            )
        tokens = greedy_ids(logits)
        if batch is None:
            return tokens
        sampled = ~batch.greedy
        if bool(sampled.any()):
            rows = sampled.nonzero().squeeze(1)
            sub = batch.select(rows)
            probs = target_probs(logits[rows], sub.temperature, sub.top_k, sub.top_p)
            tokens[rows] = categorical(probs, sub.seeds, sub.counters, STREAM_SAMPLE)
        return tokens
