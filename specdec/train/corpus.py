"""The offline training corpus: the running interpreter's standard-library sources plus pydoc's topics.

Both exist on every CPython installation, so training needs no download. The document order is
fixed (sorted relative paths, then sorted topic names) and the train/validation split hashes each
document's name, so a given interpreter always yields the same corpus and the same split; another
Python version yields a different (but equally deterministic) corpus, since its stdlib differs.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Iterator

import attrs

SPLITS = ("train", "validation", "all")

# Folders whose files are tests or installed third-party packages rather than stdlib code.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Top-level folders skipped: `encodings` is mostly generated codec tables (1.4 MB of hex literals
# that would only teach the model to emit tables); `pydoc_data` holds the topics, added as prose.
_SKIPPED_TOP = frozenset({"encodings", "pydoc_data"})


@attrs.frozen
class Document:
    """One training document: a stdlib module or one pydoc topic."""

    name: str  # "stdlib/json/decoder.py" or "pydoc/topics/assert"
    text: str


def _validated_fraction(instance, attribute, value) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{attribute.name} must be in [0, 1), got {value!r}; use e.g. 0.05")


@attrs.frozen
class CorpusConfig:
    """Which documents make up the corpus and how they are split."""

    include_stdlib: bool = True
    include_topics: bool = True
    validation_fraction: float = attrs.field(default=0.05, validator=_validated_fraction)
    stdlib_dir: str | None = None  # None: the running interpreter's stdlib folder

    def __attrs_post_init__(self) -> None:
        if not (self.include_stdlib or self.include_topics):
            raise ValueError("the corpus would be empty: set include_stdlib or include_topics")


def stdlib_root(config: CorpusConfig | None = None) -> Path:
    """The folder holding the standard library's ``*.py`` sources."""
    explicit = config.stdlib_dir if config is not None else None
    root = Path(explicit) if explicit else Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib folder {str(root)!r} does not exist; pass stdlib_dir=<folder with *.py>")
    return root


def _stdlib_files(root: Path) -> list[Path]:
    files = []
    for folder, subfolders, names in os.walk(root):
        # Pruned while walking: site-packages alone can hold most of the tree.
        top = Path(folder) == root
        subfolders[:] = [d for d in subfolders if d not in _SKIPPED_DIRS and not (top and d in _SKIPPED_TOP)]
        files += [Path(folder) / name for name in names if name.endswith(".py")]
    # Sort on the POSIX relative path so the order does not depend on the filesystem.
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _iter_stdlib(root: Path) -> Iterator[Document]:
    for path in _stdlib_files(root):
        # A handful of stdlib files carry Latin-1 test strings; replacement keeps them usable.
        text = path.read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            yield Document(f"stdlib/{path.relative_to(root).as_posix()}", text)


def _iter_topics() -> Iterator[Document]:
    from pydoc_data.topics import topics

    for key in sorted(topics):
        text = topics[key]
        if text.strip():
            yield Document(f"pydoc/topics/{key}", text)


def split_of(name: str, validation_fraction: float) -> str:
    """``"validation"`` or ``"train"``, from a hash of the document name (stable across runs and machines)."""
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") / 2**64
    return "validation" if bucket < validation_fraction else "train"


def iter_documents(split: str = "all", config: CorpusConfig | None = None) -> Iterator[Document]:
    """The corpus documents of ``split`` (``"train"``, ``"validation"`` or ``"all"``) in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
    config = config or CorpusConfig()
    sources: list[Iterator[Document]] = []
    if config.include_stdlib:
        sources.append(_iter_stdlib(stdlib_root(config)))
    if config.include_topics:
        sources.append(_iter_topics())
    for source in sources:
        for doc in source:
            if split == "all" or split_of(doc.name, config.validation_fraction) == split:
                yield doc


def load_documents(split: str = "all", config: CorpusConfig | None = None) -> list[Document]:
    """:func:`iter_documents` as a list, with an error if the split came out empty."""
    docs = list(iter_documents(split, config))
    if not docs:
        raise RuntimeError(
            f"the {split!r} corpus split is empty; check that the stdlib folder holds *.py files "
            "or lower validation_fraction"
        )
    return docs


def corpus_fingerprint(docs: list[Document]) -> str:
    """A short hash of the documents' names and texts, recorded with every trained asset."""
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(doc.name.encode())
        digest.update(b"\0")
        digest.update(doc.text.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


def validation_prompts(tokenizer_dir: str | Path, count: int, length: int,
                       config: CorpusConfig | None = None) -> list[list[int]] | None:
    """``count`` prompts of ``length`` token ids: windows of the validation split, which no zoo model trained on.

    Windows are taken every ``4 * length`` tokens through the documents in order, so the same
    arguments give the same prompts. None when ``tokenizer_dir`` holds no tokenizer.
    """
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except (OSError, ValueError):  # no tokenizer files in the folder
        return None
    prompts: list[list[int]] = []
    for doc in iter_documents("validation", config):
        ids = tokenizer(doc.text)["input_ids"]
        for start in range(0, len(ids) - length, 4 * length):
            prompts.append(ids[start : start + length])
            if len(prompts) == count:
                return prompts
    return prompts
