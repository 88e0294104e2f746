"""The engine: the scheduler, pool registration and checks, and the speculative engine step."""

from specdec.engine.engine import EngineStats, LLMEngine
from specdec.engine.pools import EnginePools, register_pools
from specdec.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from specdec.runtime.model_runner import Chunk, ModelRunner
from specdec.runtime.sequence import Sequence, SequenceStatus

__all__ = [
    "Chunk",
    "EnginePools",
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
