"""Content keys of KV pages: chained hashes over the token ids each full page depends on.

A page of ``block_size`` positions ``[i * B, (i + 1) * B)`` of a causal model holds KV that depends on
every token up to its last position, so its key chains the previous page's key with its own tokens
(vLLM's block hashes). Some pages also depend on the token *after* the page: a shifted EAGLE3 draft
writes (token ``p + 1``, target state ``h_p``) at position ``p``, so its page's last row depends on
token ``(i + 1) * B``. Such a pool is *successor-keyed*: its page key also hashes that token, so a page
computed for another continuation is never served.

Keys are 16-byte BLAKE2b digests (collisions are out of reach, unlike Python's 64-bit ``hash``); a
request's chain is computed incrementally, once per page, as its tokens arrive.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

_ROOT = b"specdec-page-keys-v1"


def page_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a page holding ``tokens`` after the pages whose last key is ``parent``."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def successor_key(key: bytes, successor: int) -> bytes:
    """The key of a successor-keyed page: its plain ``key`` and the token that follows the page."""
    return hashlib.blake2b(key + array("q", (successor,)).tobytes(), digest_size=16, person=b"succ").digest()


def target_only_key(key: bytes) -> bytes:
    """The key of a page of a pool the target shares with a draft, published where only the target's
    rows are final (a request that keeps no draft state): only a request that reads the target's rows
    alone may reuse it."""
    return hashlib.blake2b(key, digest_size=16, person=b"target-only").digest()


class PageKeyChain:
    """One request's chained page keys at one page size (grown with :meth:`extend`)."""

    __slots__ = ("block_size", "keys")

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.keys: list[bytes] = []

    def extend(self, tokens: Sequence[int], num_pages: int) -> None:
        """Key pages ``0 .. num_pages - 1`` of ``tokens`` (which must cover them); computes only the
        pages not keyed yet (a request's tokens only grow, so earlier keys stay valid)."""
        bs, keys = self.block_size, self.keys
        if num_pages * bs > len(tokens):
            raise ValueError(f"{num_pages} pages of {bs} tokens need {num_pages * bs} tokens, got {len(tokens)}")
        parent = keys[-1] if keys else _ROOT
        for i in range(len(keys), num_pages):
            parent = page_key(parent, tokens[i * bs : (i + 1) * bs])
            keys.append(parent)

    def pool_keys(self, tokens: Sequence[int], first: int, end: int, successor_keyed: bool) -> list[bytes]:
        """Keys of pages ``first .. end - 1`` for a pool; a successor-keyed pool's page ``i`` also hashes
        token ``(i + 1) * block_size``, which ``tokens`` must then hold."""
        self.extend(tokens, end)
        keys = self.keys[first:end]
        if not successor_keyed:
            return keys
        bs = self.block_size
        if end > first and end * bs >= len(tokens):
            raise ValueError(f"successor keys of {end} pages need token {end * bs}, got {len(tokens)} tokens")
        return [successor_key(k, tokens[(i + 1) * bs]) for i, k in enumerate(keys, start=first)]
