"""Text of generated tokens as it grows: incremental detokenization and stop strings.

Tokens arrive a few at a time (a speculative step emits several). :class:`TextStream` turns them into
text one token at a time, so that

- a multi-byte character split across tokens is emitted whole, never as a broken byte sequence
  (byte-level BPE decodes an incomplete one to U+FFFD: such text is held back until it completes);
- a stop string ends the output before its first occurrence, at the token that completed it (tokens
  after it, even of the same step, are dropped), whatever the step boundaries were: speculative and
  plain decoding stop at the same token;
- a streaming client is sent only text that can no longer turn out to begin a stop string.

Without stop strings nothing is decided per token, so tokens are decoded only when the text is read:
``LLM.generate`` reads it once, when the request finishes (a streaming server reads it every step).
"""

from __future__ import annotations

from typing import Sequence

_INCOMPLETE = "\ufffd"


class TextStream:
    """One request's output text, fed with its new tokens step by step.

    ``stop`` strings end the text before their first occurrence. After :meth:`push`, ``text`` is the
    output so far (the output tokens decoded as a whole, special tokens skipped, as
    ``tokenizer.decode`` gives them), ``num_tokens`` how many pushed tokens it kept (all, or up to the
    one completing a stop string) and ``stopped`` whether a stop string ended it.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._decoded = 0  # ids[:_decoded] are in the text; without stop strings the rest wait for a read
        # Each token decodes a short window: ids[_prefix:_read] were decoded last time, then the new one.
        self._prefix = self._read = 0
        self._stops = tuple(s for s in stop if s)
        self._longest_stop = max(map(len, self._stops), default=0)  # how far back a new piece may complete one
        self._text = ""
        self.num_tokens = 0
        self.stopped = False
        self._sent = 0

    @property
    def text(self) -> str:
        while self._decoded < len(self._ids):
            self._decode_next()
        return self._text

    def push(self, token_ids: Sequence[int]) -> None:
        """Add the step's new tokens (ignored once a stop string has ended the text)."""
        if not self._stops:
            self._ids += token_ids
            self.num_tokens += len(token_ids)
            return
        for token in token_ids:
            if self.stopped:
                return
            self._ids.append(token)
            self.num_tokens += 1
            self._decode_next()

    def finish(self) -> None:
        """The output is complete: text held back as an unfinished character is added as it decodes
        (so ``text`` equals the whole output decoded), unless a stop string ended it."""
        if self.stopped:
            return
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self._ids[self._prefix :], skip_special_tokens=True)
        self._text += after[len(before) :]
        self._prefix = self._read = self._decoded = len(self._ids)

    def _decode_next(self) -> None:
        """Add the next undecoded token's text, and end the text at a stop string it completes."""
        self._decoded += 1
        decode = self._tokenizer.decode
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self._ids[self._prefix : self._decoded], skip_special_tokens=True)
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return  # nothing printable yet (a special token, or half a character)
        self._prefix, self._read = self._read, self._decoded
        searched_from = max(0, len(self._text) - self._longest_stop + 1)
        self._text += after[len(before) :]
        hits = [i for i in (self._text.find(s, searched_from) for s in self._stops) if i >= 0]
        if hits:
            self._text = self._text[: min(hits)]
            self.stopped = True

    def unsent(self, finished: bool) -> str:
        """Text not yet handed to a streaming client that is safe to send: all of it once ``finished``,
        else all but a tail that could still begin a stop string."""
        end = len(self.text) if finished else len(self.text) - self._held_back()
        if end <= self._sent:
            return ""
        piece, self._sent = self.text[self._sent : end], end
        return piece

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        tail = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self.text)), tail, -1):
                if self.text.endswith(stop[:n]):
                    tail = n
                    break
        return tail
