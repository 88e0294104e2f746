"""Small corpus and tokenizer shared by the training tests (built once per session, offline)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from specdec.train.corpus import CorpusConfig, load_documents
from specdec.train.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer

# The stdlib's json package (a few files) plus the pydoc topics: real text, trained on in seconds.
SMALL_CORPUS = CorpusConfig(
    stdlib_dir=str(Path(sysconfig.get_paths()["stdlib"]) / "json"),
    include_topics=True,
    validation_fraction=0.1,
)
SMALL_VOCAB = 400


@pytest.fixture(scope="session")
def small_corpus() -> CorpusConfig:
    return SMALL_CORPUS


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    docs = load_documents("train", SMALL_CORPUS)
    save_tokenizer(train_tokenizer((d.text for d in docs), TokenizerConfig(vocab_size=SMALL_VOCAB)), folder)
    return folder
