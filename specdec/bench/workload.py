"""The benchmark's workloads: which requests a run sends, and where their prompts come from.

- ``single`` (the default): independent prompts of ``input_len`` tokens, or a JSONL dataset's.
- ``shared-prefix``: ``num_prompts`` requests over ``num_prefixes`` system prompts of ``prefix_len``
  tokens; request ``i`` is system prompt ``i % num_prefixes`` followed by a user suffix of its own of
  ``input_len`` tokens.
- ``multi-turn``: ``num_prompts`` conversations of ``num_turns`` turns. Turn 1's prompt is a user
  message of ``input_len`` tokens; turn ``n + 1``'s is turn ``n``'s prompt + turn ``n``'s generated
  output + a new user message of ``input_len`` tokens, so a conversation's turns run one after
  another, each once the previous one's output is known (:meth:`Workload.follow_up`).

Prompt sources (``--prompt-source``; a ``--dataset`` replaces them for ``single``):

- ``held-out`` (the default): text no zoo model trained on. ``scripts/build_zoo.py`` trains the
  tokenizer, every target and every draft on the *train* split of the offline corpus
  (:mod:`specdec.train.corpus`: the interpreter's standard-library sources plus pydoc's topics; the
  drafts' self-distilled text is the target's continuation of train-split windows); the
  *validation* split (about 5% of the documents, chosen by a hash of each document's name, so a
  file is held out on every machine and Python version) is only ever evaluated on. The prompts come
  from its stdlib files only: pydoc's topics repeat one another (most of a held-out topic's text
  is also in a training topic). Those files, in their fixed order, through the model folder's
  tokenizer, make one token stream; a workload's windows are non-overlapping and spread evenly over
  all of it (each window starts an equal share of the remaining slack after the previous one), so
  prompts sample every held-out file rather than the first. A window holding a ``COPY_PIECE``-token
  piece (of its consecutive pieces from its start) found verbatim in the training text (a licence
  header, a function two modules share) moves on by a piece until it holds none, so no prompt
  shares a span of ``2 * COPY_PIECE`` tokens or more with what the models trained on. The same
  arguments give the same prompts (per Python version: the stdlib's text differs between versions).
  Nothing to download: every Python installation has it.
- ``synthetic``: token ids drawn uniformly from the model's vocabulary (special tokens left out)
  with ``seed``; the default for a model folder without a tokenizer.

Warm-up requests get prompts of their own, never a run's, so a run's prefix-cache hits come from
its own workload only. :attr:`Workload.source` names the source, for the table and ``--json``.
"""

from __future__ import annotations

import functools
import json
import random
import sys
from pathlib import Path
from typing import Sequence

import attrs

DEFAULT_PROMPTS = 16
WORKLOADS = ("single", "shared-prefix", "multi-turn")
PROMPT_SOURCES = ("held-out", "synthetic")
HELD_OUT = (f"held-out text (Python {sys.version_info[0]}.{sys.version_info[1]} stdlib files of the training "
            "corpus's validation split, no zoo model trained on)")
SYNTHETIC = "synthetic token ids (uniform over the vocabulary)"
COPY_PIECE = 32  # tokens: a held-out window holding a piece this long found verbatim in the training text is skipped


@attrs.frozen
class Workload:
    """A run's requests: ``prompts`` (every request; in multi-turn, each conversation's first turn),
    ``messages`` (multi-turn: per conversation, the user messages of turns 2, 3, ...; else empty),
    ``warmup`` (the uncounted requests' prompts), and for a person reading the results, ``description``
    (its shape) and ``source`` (where its prompts come from)."""

    name: str
    prompts: list[list[int]]
    warmup: list[list[int]]
    description: str
    source: str
    messages: list[list[list[int]]] = attrs.Factory(list)
    output_lens: list[int] = attrs.Factory(list)  # per conversation (every turn of it), set by load_workload

    def follow_up(self, conversation: int, turn: int, prompt: Sequence[int], output: Sequence[int]) -> list[int] | None:
        """The next prompt of ``conversation`` once its turn ``turn`` (from 0) turned ``prompt`` into
        ``output``: prompt + output + the next user message; None when the conversation is over."""
        later = self.messages[conversation] if self.messages else ()
        return [*prompt, *output, *later[turn]] if turn < len(later) else None

    def prompt_lengths(self) -> list[int]:
        """Every request's prompt length in run order (conversation by conversation, turn by turn),
        each request generating its conversation's ``output_lens`` tokens."""
        lengths = []
        for conversation, prompt in enumerate(self.prompts):
            n = len(prompt)
            lengths.append(n)
            for message in self.messages[conversation] if self.messages else ():
                n += self.output_lens[conversation] + len(message)
                lengths.append(n)
        return lengths


def output_lengths(count: int, output_len: int, spread: float, seed: int) -> list[int]:
    """``count`` output lengths drawn uniformly from ``output_len`` x [1 - spread, 1 + spread] (at
    least 1), all ``output_len`` when ``spread`` is 0."""
    if not spread:
        return [output_len] * count
    low, high = max(1, round(output_len * (1 - spread))), round(output_len * (1 + spread))
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(count)]


def synthetic_windows(lengths: Sequence[int], vocab_size: int, exclude: Sequence[int], seed: int) -> list[list[int]]:
    """One list of ids per length, drawn uniformly from ``range(vocab_size)`` minus ``exclude``."""
    skip = set(exclude)
    allowed = [t for t in range(vocab_size) if t not in skip]
    if not allowed:
        raise ValueError("the model's vocabulary holds only special tokens; pass --dataset with real prompts")
    rng = random.Random(seed)
    return [[rng.choice(allowed) for _ in range(n)] for n in lengths]


def synthetic_prompts(num: int, input_len: int, vocab_size: int, exclude: Sequence[int], seed: int) -> list[list[int]]:
    """``num`` prompts of ``input_len`` ids drawn uniformly from ``range(vocab_size)`` minus ``exclude``."""
    return synthetic_windows([input_len] * num, vocab_size, exclude, seed)


@functools.cache
def _corpus() -> tuple[tuple[str, ...], str]:
    """(held-out texts, training text): the offline corpus's validation-split stdlib files in their
    fixed order, and every train-split document (what the zoo trained on) joined by NULs."""
    from specdec.train.corpus import CorpusConfig, iter_documents, split_of

    config = CorpusConfig()  # scripts/build_zoo.py's
    held_out, train = [], []
    for doc in iter_documents("all", config):
        if split_of(doc.name, config.validation_fraction) == "train":
            train.append(doc.text)
        elif doc.name.startswith("stdlib/"):
            held_out.append(doc.text)
    return tuple(held_out), "\0".join(train)


def _copied(tokenizer, window: Sequence[int], training_text: str) -> bool:
    """Whether one of the window's consecutive ``COPY_PIECE``-token pieces occurs verbatim in the training text."""
    return any(tokenizer.decode(window[i : i + COPY_PIECE]) in training_text
               for i in range(0, len(window) - COPY_PIECE + 1, COPY_PIECE))


def held_out_windows(tokenizer, lengths: Sequence[int]) -> list[list[int]]:
    """Non-overlapping windows of ``lengths`` tokens of held-out text (no special tokens), spread evenly
    over the whole held-out stream, in order; a window with a piece copied from the training text
    moves on past it (see the module docstring)."""
    texts, training_text = _corpus()
    stream: list[int] = []
    for ids in tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]:
        stream += ids
    rest = sum(lengths)  # tokens of the windows not cut yet
    if len(stream) < rest:
        raise ValueError(f"the held-out text holds {len(stream)} tokens, fewer than the {rest} this workload needs; "
                         "lower --num-prompts, --input-len, --prefix-len or --num-turns")
    windows, start = [], 0
    for i, n in enumerate(lengths):
        while start + rest <= len(stream) and _copied(tokenizer, stream[start : start + n], training_text):
            start += COPY_PIECE
        if start + rest > len(stream):
            raise ValueError("the held-out text has too few tokens not copied from the training text for this "
                             "workload; lower --num-prompts, --input-len, --prefix-len or --num-turns")
        windows.append(stream[start : start + n])
        rest -= n
        start += n + (len(stream) - start - n - rest) // (len(lengths) - i)  # an equal share of what is left
    return windows


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


def _synthetic(model: str, tokenizer, lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Synthetic prompts of ``lengths`` over the model's vocabulary, special tokens left out."""
    text = text_config(model)
    vocab = int(text.vocab_size)
    special = _ids(getattr(text, "bos_token_id", None)) + _ids(getattr(text, "eos_token_id", None))
    special += _ids(getattr(text, "pad_token_id", None))
    if tokenizer is not None:
        vocab = min(vocab, len(tokenizer))
        special += list(tokenizer.all_special_ids)
    return synthetic_windows(lengths, vocab, special, seed)


def _windows(config, tokenizer, lengths: Sequence[int]) -> tuple[list[list[int]], str]:
    """Windows of ``lengths`` tokens from the config's prompt source, and the source's name."""
    source = config.prompt_source or ("held-out" if tokenizer is not None else "synthetic")
    if source == "synthetic":
        name = SYNTHETIC if tokenizer is not None else f"{SYNTHETIC[:-1]}; the model folder has no tokenizer)"
        return _synthetic(config.model, tokenizer, lengths, config.seed), name
    if tokenizer is None:
        raise ValueError("--prompt-source held-out is text, but the model folder has no tokenizer; "
                         "use --prompt-source synthetic or a --dataset of prompt_token_ids")
    return held_out_windows(tokenizer, lengths), HELD_OUT


def load_workload(config) -> Workload:
    """The :class:`Workload` of a :class:`~specdec.bench.config.BenchConfig` (see the module docstring),
    with its conversations' output lengths (:func:`output_lengths`)."""
    workload = _prompts_of(config)
    lens = output_lengths(len(workload.prompts), config.output_len, config.output_spread, config.seed)
    return attrs.evolve(workload, output_lens=lens)


def _prompts_of(config) -> Workload:
    from specdec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    n, warmup, input_len = config.num_prompts or DEFAULT_PROMPTS, config.warmup, config.input_len
    if config.workload == "single":
        if config.dataset is not None:
            prompts = read_dataset(config.dataset, tokenizer, config.num_prompts)
            warm = _synthetic(config.model, tokenizer, [len(prompts[i % len(prompts)]) for i in range(warmup)],
                              config.seed + 1)
            return Workload("single", prompts, warm, "single prompts", f"dataset {config.dataset}")
        windows, source = _windows(config, tokenizer, [input_len] * (n + warmup))
        return Workload("single", windows[:n], windows[n:], f"single prompts of {input_len} tokens", source)
    if config.workload == "shared-prefix":
        k = config.num_prefixes
        lengths = [config.prefix_len] * k + [input_len] * n + [config.prefix_len + input_len] * warmup
    else:
        k = config.num_turns
        lengths = [input_len] * (n * k + warmup)
    windows, source = _windows(config, tokenizer, lengths)
    if config.workload == "shared-prefix":
        systems, suffixes = windows[:k], windows[k : k + n]
        prompts = [systems[i % k] + suffixes[i] for i in range(n)]
        shape = f"{n} requests over {k} system prompts of {config.prefix_len} tokens + user suffixes of {input_len}"
        return Workload("shared-prefix", prompts, windows[k + n :], shape, source)
    conversations = [windows[c * k : (c + 1) * k] for c in range(n)]
    shape = f"{n} conversations of {k} turns, user messages of {input_len} tokens"
    return Workload("multi-turn", [c[0] for c in conversations], windows[n * k :], shape, source,
                    [c[1:] for c in conversations])


def load_prompts(config) -> list[list[int]]:
    """The prompts of a :class:`~specdec.bench.config.BenchConfig`'s workload (multi-turn: the first turns)."""
    return load_workload(config).prompts
