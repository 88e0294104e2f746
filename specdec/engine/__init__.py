"""The engine: sequences, scheduler, model runner and the speculative engine step."""

from specdec.engine.engine import EngineStats, LLMEngine, register_pools
from specdec.engine.model_runner import Chunk, ModelRunner
from specdec.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from specdec.engine.sequence import Sequence, SequenceStatus

__all__ = [
    "Chunk",
    "EngineStats",
    "LLMEngine",
    "ModelRunner",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "SequenceStatus",
    "register_pools",
]
