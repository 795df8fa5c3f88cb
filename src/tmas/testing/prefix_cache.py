"""An emulated server prefix cache: fixed-size blocks of prompt tokens, hashed as a chain, least recently used out.

This is how vLLM's automatic prefix caching and SGLang's radix cache behave as seen from a client: a prompt's
leading tokens are served from the cache as far as whole blocks of it were computed before and not yet evicted; the
rest is computed and its blocks enter the cache. One :class:`PrefixCache` stands for one replica's KV memory.
llama-server caches differently, one prompt per slot: :class:`SlotCache`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache

from tmas.testing.responders import TOKEN_RE


@lru_cache(maxsize=8192)  # system prompts and shared context repeat across thousands of calls
def _text_tokens(text: str) -> tuple[str, ...]:
    return tuple(TOKEN_RE.findall(text))


def prompt_tokens(messages: Sequence[tuple[str, str]]) -> list[str]:
    """The tokens of a chat prompt as the simulator counts them, with each message's role marker before its text."""
    tokens: list[str] = []
    for role, content in messages:
        tokens.append(f"<|{role}|>")
        tokens.extend(_text_tokens(content))
    return tokens


class PrefixCache:
    """LRU cache of token blocks: :meth:`serve` says how many of a prompt's leading tokens were cached, then caches
    all of its whole blocks (a partial last block is never reused, as in vLLM). The last prompt token is always
    computed again, its logits start the reply: a hit stops one token short of the prompt (vLLM's
    kv_cache_manager caps it at the prompt's length less one; SGLang's scheduler likewise)."""

    def __init__(self, capacity_tokens: int, block_tokens: int = 16) -> None:
        if block_tokens < 1 or capacity_tokens < block_tokens:
            raise ValueError("a prefix cache needs at least one block of at least one token")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def _chain(self, tokens: Sequence[str]) -> list[int]:
        """Each whole block's hash, chained to the blocks before it (a block is reused only after the same prefix).
        Python's own tuple hash, not a digest: it costs a fraction, and one replica's cache lives in one process."""
        hashes: list[int] = []
        previous = 0
        b = self.block_tokens
        for start in range(0, len(tokens) - b + 1, b):
            previous = hash((previous, *tokens[start : start + b]))
            hashes.append(previous)
        return hashes

    def _usable(self, tokens: Sequence[str]) -> int:
        """Blocks of a prompt a hit may cover: all but its last token."""
        return max(len(tokens) - 1, 0) // self.block_tokens

    def lookup(self, tokens: Sequence[str]) -> int:
        """Leading tokens of ``tokens`` the cache would serve now (nothing is changed)."""
        hits = 0
        for block in self._chain(tokens)[: self._usable(tokens)]:
            if block not in self._blocks:
                break
            hits += 1
        return hits * self.block_tokens

    def serve(self, tokens: Sequence[str]) -> int:
        """Serve a prompt: the leading tokens found cached; afterwards every whole block of it is cached, most
        recently used, and the least recently used blocks beyond the capacity are evicted. A prompt's blocks are
        touched from its end back to its start, so a prefix outlives the tails that follow it (vLLM frees a
        request's blocks in reverse order; SGLang's radix tree evicts leaves first)."""
        chain = self._chain(tokens)
        hits = 0
        for block in chain[: self._usable(tokens)]:
            if block not in self._blocks:
                break
            hits += 1
        for block in reversed(chain):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        return hits * self.block_tokens


class SlotCache:
    """llama-server's prompt cache: each slot keeps the last prompt it processed, and a new prompt reuses its common
    prefix with the slot's one. A request naming a slot (``id_slot``) goes there; any other goes to the slot whose
    prompt it resembles most (common prefix over the new prompt's length above ``similarity``, the server's
    ``--slot-prompt-similarity``, 0.1 by default), else to the least recently used slot (tools/server
    server-context.cpp, get_available_slot). Busy slots are not modelled: every slot is a candidate."""

    def __init__(self, slots: int, similarity: float = 0.1) -> None:
        self.similarity = similarity
        self._prompts: list[Sequence[str]] = [() for _ in range(slots)]
        self._last_used = [0] * slots
        self._tick = 0

    def __len__(self) -> int:
        return len(self._prompts)

    def prompt(self, slot: int) -> Sequence[str]:
        """The prompt slot ``slot`` holds now."""
        return self._prompts[slot]

    def pick(self, tokens: Sequence[str]) -> int:
        """The slot a prompt without ``id_slot`` goes to."""
        best, best_share = -1, self.similarity
        for slot, cached in enumerate(self._prompts):
            share = _common_prefix(cached, tokens) / len(tokens) if tokens and cached else 0.0
            if share > best_share:
                best, best_share = slot, share
        if best >= 0:
            return best
        return min(range(len(self._prompts)), key=self._last_used.__getitem__)

    def serve(self, tokens: Sequence[str], slot: int | None = None) -> tuple[int, int]:
        """(the slot used, prompt tokens reused from its cache). At least one token is always computed again: the
        server needs its logits to start generating."""
        if slot is None:
            slot = self.pick(tokens)
        reused = min(_common_prefix(self._prompts[slot], tokens), max(len(tokens) - 1, 0))
        self._prompts[slot] = tokens
        self._tick += 1
        self._last_used[slot] = self._tick
        return slot, reused


def _common_prefix(a: Sequence[str], b: Sequence[str]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
