from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from specdec.train.corpus import CorpusConfig, corpus_fingerprint, iter_documents, load_documents, split_of


def test_full_corpus_is_large_deterministic_and_split_disjointly():
    first = load_documents("all")
    second = load_documents("all")
    assert [d.name for d in first] == [d.name for d in second]
    assert corpus_fingerprint(first) == corpus_fingerprint(second)
    # Megabytes of code plus the English topics; no tests, site-packages or codec tables.
    assert sum(len(d.text) for d in first) > 2_000_000
    names = [d.name for d in first]
    assert any(n.startswith("pydoc/topics/") for n in names)
    assert "stdlib/json/decoder.py" in names
    assert not any("/site-packages/" in n or "/test/" in n or n.startswith("stdlib/encodings/") for n in names)
    assert not any(n.startswith("stdlib/pydoc_data/") for n in names)
    stdlib = [n for n in names if n.startswith("stdlib/")]
    assert stdlib == sorted(stdlib)

    train = {d.name for d in load_documents("train")}
    val = {d.name for d in load_documents("validation")}
    assert train.isdisjoint(val)
    assert train | val == set(names)
    assert 0.01 < len(val) / len(names) < 0.15


def test_split_depends_only_on_the_name():
    assert split_of("stdlib/json/decoder.py", 0.05) == split_of("stdlib/json/decoder.py", 0.05)
    assert split_of("anything", 0.0) == "train"
    fractions = [split_of(f"doc{i}", 0.3) for i in range(2000)]
    assert 0.25 < fractions.count("validation") / 2000 < 0.35


def test_stdlib_dir_override_and_topics_only(small_corpus):
    docs = load_documents("all", small_corpus)
    assert {d.name for d in docs if d.name.startswith("stdlib/")} >= {"stdlib/decoder.py", "stdlib/encoder.py"}
    topics = list(iter_documents("all", CorpusConfig(include_stdlib=False)))
    assert topics and all(d.name.startswith("pydoc/topics/") for d in topics)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(validation_fraction=1.0), "validation_fraction"),
        (dict(include_stdlib=False, include_topics=False), "empty"),
    ],
)
def test_bad_corpus_config_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CorpusConfig(**kwargs)


def test_bad_split_and_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="unknown split"):
        list(iter_documents("dev"))
    with pytest.raises(FileNotFoundError, match="stdlib_dir"):
        list(iter_documents("all", CorpusConfig(stdlib_dir=str(tmp_path / "nope"))))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RuntimeError, match="empty"):
        load_documents("all", CorpusConfig(stdlib_dir=str(empty), include_topics=False))


def test_stdlib_root_is_the_running_interpreters():
    docs = load_documents("train", CorpusConfig(include_topics=False, validation_fraction=0.0))
    root = Path(sysconfig.get_paths()["stdlib"])
    assert (root / docs[0].name.removeprefix("stdlib/")).is_file()
