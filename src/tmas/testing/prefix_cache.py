"""An emulated server prefix cache: fixed-size blocks of prompt tokens, hashed as a chain, least recently used out.

This is how vLLM's automatic prefix caching and SGLang's radix cache behave as seen from a client: a prompt's
leading tokens are served from the cache as far as whole blocks of it were computed before and not yet evicted; the
rest is computed and its blocks enter the cache. One :class:`PrefixCache` stands for one replica's KV memory.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from tmas.testing.responders import TOKEN_RE


def prompt_tokens(messages: Sequence[tuple[str, str]]) -> list[str]:
    """The tokens of a chat prompt as the simulator counts them, with each message's role marker before its text."""
    tokens: list[str] = []
    for role, content in messages:
        tokens.append(f"<|{role}|>")
        tokens.extend(TOKEN_RE.findall(content))
    return tokens


class PrefixCache:
    """LRU cache of token blocks: :meth:`serve` says how many of a prompt's leading tokens were cached, then caches
    all of its whole blocks (a partial last block is never reused, as in vLLM)."""

    def __init__(self, capacity_tokens: int, block_tokens: int = 16) -> None:
        if block_tokens < 1 or capacity_tokens < block_tokens:
            raise ValueError("a prefix cache needs at least one block of at least one token")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def _chain(self, tokens: Sequence[str]) -> list[bytes]:
        """Each whole block's hash, chained to the blocks before it (a block is reused only after the same prefix)."""
        hashes: list[bytes] = []
        previous = b""
        b = self.block_tokens
        for start in range(0, len(tokens) - b + 1, b):
            digest = hashlib.blake2b(previous, digest_size=16)
            digest.update("\x1f".join(tokens[start : start + b]).encode())
            previous = digest.digest()
            hashes.append(previous)
        return hashes

    def lookup(self, tokens: Sequence[str]) -> int:
        """Leading tokens of ``tokens`` the cache holds now (nothing is changed)."""
        hits = 0
        for block in self._chain(tokens):
            if block not in self._blocks:
                break
            hits += 1
        return hits * self.block_tokens

    def serve(self, tokens: Sequence[str]) -> int:
        """Serve a prompt: the leading tokens found cached; afterwards every whole block of it is cached, most
        recently used, and the least recently used blocks beyond the capacity are evicted."""
        hits = 0
        missed = False
        for block in self._chain(tokens):
            if not missed and block in self._blocks:
                hits += 1
                self._blocks.move_to_end(block)
            else:
                missed = True
                self._blocks[block] = None
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        return hits * self.block_tokens
