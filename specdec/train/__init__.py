"""Training for the tiny model zoo: offline corpus, BPE tokenizer, target LMs (and EAGLE3 drafts).

Run ``python -m specdec.train --help`` for the command line. Everything here works offline: the
corpus is the running interpreter's standard library plus ``pydoc_data.topics``.
"""

from specdec.train.corpus import CorpusConfig, Document, iter_documents, load_documents
from specdec.train.presets import PRESETS, TargetPreset, get_preset
from specdec.train.target import TargetTrainConfig, TrainResult, measure_throughput, train_target
from specdec.train.tokenizer import TokenizerConfig, load_tokenizer, save_tokenizer, train_tokenizer

__all__ = [
    "PRESETS",
    "CorpusConfig",
    "Document",
    "TargetPreset",
    "TargetTrainConfig",
    "TokenizerConfig",
    "TrainResult",
    "get_preset",
    "iter_documents",
    "load_documents",
    "load_tokenizer",
    "measure_throughput",
    "save_tokenizer",
    "train_target",
    "train_tokenizer",
]
