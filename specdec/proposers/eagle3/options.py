"""The keys the EAGLE3 methods take in a speculative config."""

from __future__ import annotations

import attrs

from specdec.proposers.options import ModelOptions, option
from specdec.validation import int_at_least


@attrs.frozen(kw_only=True)
class Eagle3Options(ModelOptions):
    """EAGLE3's keys: the model-based ones and ``draft_tensor_parallel_size`` (vLLM's name): under
    tensor parallelism the draft layer runs whole on every rank (1) or split over all of them."""

    draft_tensor_parallel_size: int | None = option(int, int_at_least(1, optional=True))
