"""What every forward runs on, below the proposers and the engine: requests (``Sequence``), the step
layout, the model runner over the paged cache, and the choice of page size."""

from specdec.runtime.block_size import PageSizeError, choose_block_size
from specdec.runtime.layout import StepLayout
from specdec.runtime.model_runner import Chunk, ModelRunner, paged_metadata
from specdec.runtime.sequence import Sequence, SequenceStatus

__all__ = [
    "Chunk",
    "ModelRunner",
    "PageSizeError",
    "Sequence",
    "SequenceStatus",
    "StepLayout",
    "choose_block_size",
    "paged_metadata",
]
