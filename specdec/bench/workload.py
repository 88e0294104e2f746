"""The benchmark's prompts: a JSONL dataset, or synthetic token ids drawn from the model's vocabulary."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Sequence

DEFAULT_SYNTHETIC_PROMPTS = 16


def synthetic_prompts(num: int, input_len: int, vocab_size: int, exclude: Sequence[int], seed: int) -> list[list[int]]:
    """``num`` prompts of ``input_len`` ids drawn uniformly from ``range(vocab_size)`` minus ``exclude``."""
    skip = set(exclude)
    allowed = [t for t in range(vocab_size) if t not in skip]
    if not allowed:
        raise ValueError("the model's vocabulary holds only special tokens; pass --dataset with real prompts")
    rng = random.Random(seed)
    return [[rng.choice(allowed) for _ in range(input_len)] for _ in range(num)]


def read_dataset(path: str | Path, tokenizer, limit: int | None) -> list[list[int]]:
    """Prompt token ids from a JSONL file: one ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` a line.

    Blank lines are skipped; text needs the model folder's tokenizer. ``limit`` keeps the first
    prompts and must not exceed how many the file has.
    """
    from specdec.tokenizer import encode

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"dataset {str(path)!r} does not exist; pass a JSONL file of {{\"prompt\": ...}} lines")
    prompts: list[list[int]] = []
    with file.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(prompts) == limit:
                break
            if not line.strip():
                continue
            where = f"{str(path)}:{lineno}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg}); each line must be one JSON object") from None
            if not isinstance(entry, dict) or ("prompt" in entry) == ("prompt_token_ids" in entry):
                raise ValueError(f'{where}: each line needs exactly one of "prompt" (a string) or "prompt_token_ids"')
            if "prompt" in entry:
                text = entry["prompt"]
                if not isinstance(text, str) or not text:
                    raise ValueError(f'{where}: "prompt" must be a non-empty string')
                if tokenizer is None:
                    raise ValueError(
                        f'{where}: a text prompt, but the model folder has no tokenizer; use "prompt_token_ids"'
                    )
                prompts.append(encode(tokenizer, text))
            else:
                ids = entry["prompt_token_ids"]
                if not (
                    isinstance(ids, list)
                    and ids
                    and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
                ):
                    raise ValueError(f'{where}: "prompt_token_ids" must be a non-empty list of token ids >= 0')
                prompts.append(list(ids))
    if not prompts:
        raise ValueError(f"dataset {str(path)!r} holds no prompts")
    if limit is not None and len(prompts) < limit:
        raise ValueError(f"dataset {str(path)!r} has only {len(prompts)} prompts; lower --num-prompts")
    return prompts


def text_config(model: str):
    from specdec.models.loader import load_config

    config = load_config(model)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def load_prompts(config) -> list[list[int]]:
    """The prompts of a :class:`~specdec.bench.config.BenchConfig` as token ids (the dataset's or synthetic)."""
    from specdec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    if config.dataset is not None:
        return read_dataset(config.dataset, tokenizer, config.num_prompts)
    text = text_config(config.model)
    vocab = int(text.vocab_size)
    special = _ids(getattr(text, "bos_token_id", None)) + _ids(getattr(text, "eos_token_id", None))
    special += _ids(getattr(text, "pad_token_id", None))
    if tokenizer is not None:
        vocab = min(vocab, len(tokenizer))
        special += list(tokenizer.all_special_ids)
    num = config.num_prompts or DEFAULT_SYNTHETIC_PROMPTS
    return synthetic_prompts(num, config.input_len, vocab, special, config.seed)
