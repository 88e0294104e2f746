"""Token streams for LM training: documents tokenized, joined with BOS/EOS, cut into fixed windows."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from specdec.train.corpus import Document
from specdec.train.tokenizer import BOS_ID, EOS_ID


def tokenize_documents(tokenizer, docs: Sequence[Document]) -> torch.Tensor:
    """One int64 stream ``<s> doc1 </s> <s> doc2 </s> ...`` in document order.

    Uses the backend tokenizer directly: the transformers wrapper would warn about documents
    longer than ``model_max_length``, which is irrelevant before windowing.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    encodings = backend.encode_batch([d.text for d in docs], add_special_tokens=False)
    pieces: list[torch.Tensor] = []
    for enc in encodings:
        pieces.append(torch.tensor([BOS_ID, *enc.ids, EOS_ID], dtype=torch.long))
    if not pieces:
        raise ValueError("no documents to tokenize; pass a non-empty corpus split")
    return torch.cat(pieces)


def windows(stream: torch.Tensor, length: int) -> torch.Tensor:
    """Non-overlapping windows ``[N, length]`` of the stream (the ragged tail is dropped)."""
    if length < 2:
        raise ValueError(f"window length must be at least 2 (input + next-token label), got {length}")
    count = stream.numel() // length
    if count == 0:
        raise ValueError(
            f"the token stream has {stream.numel()} tokens, fewer than one window of {length}; "
            "use a shorter seq_len or a larger corpus"
        )
    return stream[: count * length].view(count, length)


def spread_windows(data: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` windows evenly spaced over ``data [N, T]`` (all of them when ``N <= count``), for evaluation
    sets that sample every part of the split rather than its first documents."""
    if data.shape[0] <= count:
        return data
    return data[torch.linspace(0, data.shape[0] - 1, count).round().long()]


class WindowBatches:
    """Endless seeded batches of training windows: a fresh permutation every epoch.

    Each window holds ``seq_len + 1`` tokens so that inputs ``[:, :-1]`` and labels ``[:, 1:]``
    cover ``seq_len`` predictions. The same seed gives the same batches on every machine.
    """

    def __init__(self, stream: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        self._init(windows(stream, seq_len + 1), batch_size, seed)

    @classmethod
    def from_windows(cls, data: torch.Tensor, batch_size: int, seed: int) -> "WindowBatches":
        """Batches of ready-made windows ``[N, T]`` (e.g. text the target generated)."""
        self = cls.__new__(cls)
        self._init(data, batch_size, seed)
        return self

    def _init(self, data: torch.Tensor, batch_size: int, seed: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.data = data
        if self.data.shape[0] < batch_size:
            raise ValueError(
                f"only {self.data.shape[0]} windows of {self.data.shape[1]} tokens for batch_size {batch_size}; "
                "lower batch_size or seq_len"
            )
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0

    @property
    def num_windows(self) -> int:
        return self.data.shape[0]

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            order = torch.randperm(self.num_windows, generator=self.generator)
            for start in range(0, self.num_windows - self.batch_size + 1, self.batch_size):
                yield self.data[order[start : start + self.batch_size]]
            self.epoch += 1
