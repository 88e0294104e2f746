"""Loading a checkpoint folder's tokenizer, offline, when it has one."""

from __future__ import annotations

from pathlib import Path

# Any of these in the folder means a tokenizer was saved with the model.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(path: str | Path) -> bool:
    folder = Path(path)
    return any((folder / name).is_file() for name in _TOKENIZER_FILES)


def load_tokenizer(path: str | Path):
    """The folder's tokenizer via transformers' ``AutoTokenizer`` (local files only), or None.

    Failing to read tokenizer files that are present is an error, not a silent fallback to
    token-id-only mode.
    """
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"cannot load the tokenizer in {str(path)!r}: {err}") from None


def encode(tokenizer, text: str) -> list[int]:
    """Prompt text to ids, with the special tokens (BOS...) the tokenizer adds by default."""
    return list(tokenizer(text)["input_ids"])


def decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode(token_ids, skip_special_tokens=True)
