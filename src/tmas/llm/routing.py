"""Which replica of an endpoint a call goes to: the one holding the longest prefix of its prompt, within a load bound.

vLLM's automatic prefix caching and SGLang's radix cache skip the prefill of a prompt's leading tokens that the same
server computed before. TMAS's calls share long prefixes: a candidate's M verifications have one prompt (the problem
and the candidate) and its summary starts with that prompt; an iteration's exploit candidates share the previous
rollouts; every call of a problem starts with the system text and the problem. Sent to whichever replica has the
fewest calls in flight they land on different servers, and each pays the whole prefill again.

:class:`PrefixRouter` remembers which replicas served the prompts it sent. A prompt (its messages with their roles) is
cut into blocks of :data:`BLOCK_CHARS` characters; each block's hash is chained to the hashes of the blocks before it,
so a block matches only after the same prefix, as in the servers' own caches. A bounded LRU map takes each block's
hash to the replicas that served it (a bit set): :data:`MAX_BLOCKS` blocks, 33 million characters of prompt (several
times what 8 GPU replicas keep in their KV caches), in about 23 MiB, plus up to 8 MiB of affinity keys (measured with
tracemalloc), however many calls a run makes (164,000 at the paper's 100-problem scale). A call goes to the replica
that holds the longest known prefix of its prompt among the replicas within the load bound; ties go to the replica
that last served the call's affinity key (the TMAS candidate chain its key names, else its problem: see
:func:`tmas.llm.lanes.call_affinity`), then to the least loaded, in turn. Replicas out of routing (no server listening
at their last call, a failed /health, no progress while a call waited: :mod:`tmas.llm.vitals`; still loading their
model) are chosen only when every replica is.

**The load bound.** A replica's load is the calls this client routed to it that have not finished (waiting for a cap
or in flight: what the client knows). A replica takes a call for its cache only while its load is below
``bound x mean + 1``, the mean taken over the endpoint's replicas that answer; otherwise the call goes to the best
replica within the bound, which the least loaded always is. The ``+ 1`` lets an idle endpoint take a burst of
identical prompts (an iteration's first solutions, a candidate's verifications) two to a replica rather than one by
one. The default bound,
1.1, is the target spread (the busiest replica within 10 % of the mean) applied to the calls in
flight at each moment, and it is what ``benchmarks/replica_routing.py`` confirmed on the paper's call shapes over 8
replicas (docs/performance.md): with 8 to 32 problems in flight the busiest replica stayed within 8 % of the mean in
calls and tokens, with 86-89 % of the cache hits one replica with all the KV memory gets; 1.2 let the spread pass
10 % with one problem per replica, and 1.0 lost about a quarter of the hits.

Hashing a prompt costs one slice and one tuple hash per block (a 100 KB prompt: 400 of each); the lookup walks the
prompt's blocks until no replica within the bound holds the next one, never the whole map.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, TypeVar

from tmas.llm.types import Message

# Characters per block: about 64 tokens. A prefix shorter than a block is never matched; a longer one loses at most
# its last partial block.
BLOCK_CHARS = 256
# Block hashes remembered (least recently used out): 2**17 blocks of 256 characters, about 8 million tokens.
MAX_BLOCKS = 2**17
# Affinity keys remembered (chains and problems; a run has at most N x T chains per problem in flight).
MAX_KEYS = 2**16


class Replica(Protocol):
    """What the router reads of a replica."""

    @property
    def url(self) -> str: ...

    @property
    def load(self) -> int: ...

    @property
    def avoided(self) -> bool: ...


R = TypeVar("R", bound=Replica)


def prompt_blocks(messages: Sequence[Message], block_chars: int = BLOCK_CHARS) -> list[int]:
    """The chained hash of each block of the rendered prompt, the last (partial) block included.

    Python's own hash: fast, and stable within the process, which is all a router needs."""
    text = "".join(f"\x00{m.role}\x00{m.content}" for m in messages)
    hashes: list[int] = []
    previous = 0
    for start in range(0, len(text), block_chars):
        previous = hash((previous, text[start : start + block_chars]))
        hashes.append(previous)
    return hashes


class PrefixRouter:
    """One client's memory of which replica served which prompt prefix, and its choice of replica for a call."""

    def __init__(
        self, *, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS, max_keys: int = MAX_KEYS
    ) -> None:
        self.block_chars = block_chars
        self.max_blocks = max_blocks
        self.max_keys = max_keys
        # Block hash -> bit set of the replicas (by their index in _ids) that served a prompt with that prefix.
        self._blocks: OrderedDict[int, int] = OrderedDict()
        # Affinity key -> the replica that last served one of its calls.
        self._keys: OrderedDict[str, int] = OrderedDict()
        self._ids: dict[str, int] = {}
        self._turn = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def least_loaded(self, replicas: Sequence[R]) -> R:
        """The replica with the least load among those that answer; ties in turn, so equal replicas share the load
        evenly."""
        self._turn += 1
        n = len(replicas)
        order = [replicas[(self._turn + i) % n] for i in range(n)]
        return min(order, key=lambda r: (r.avoided, r.load))

    def choose(self, messages: Sequence[Message], replicas: Sequence[R], key: str | None, bound: float) -> R:
        """The replica for a call (see the module's docstring), remembered as the one now holding its prompt."""
        if len(replicas) == 1:
            return replicas[0]
        blocks = prompt_blocks(messages, self.block_chars)
        answering = [r for r in replicas if not r.avoided]
        if not answering:
            chosen = self.least_loaded(replicas)
        else:
            # Over the replicas that answer: the least loaded of them is always within the bound.
            mean = sum(r.load for r in answering) / len(answering)
            within = [r for r in answering if r.load < bound * mean + 1]
            chosen = self._longest_prefix(blocks, within, key)
        self._remember(blocks, key, chosen)
        return chosen

    def _id(self, replica: Replica) -> int:
        return self._ids.setdefault(replica.url, len(self._ids))

    def _longest_prefix(self, blocks: list[int], replicas: Sequence[R], key: str | None) -> R:
        """Among ``replicas``, those holding the most leading blocks; then the key's replica; then the least loaded."""
        alive = 0
        for replica in replicas:
            alive |= 1 << self._id(replica)
        for block in blocks:
            holders = alive & self._blocks.get(block, 0)
            if not holders:
                break
            alive = holders
        best = [r for r in replicas if alive >> self._id(r) & 1]
        if key is not None and len(best) > 1:
            preferred = self._keys.get(key)
            for replica in best:
                if self._id(replica) == preferred:
                    return replica
        return self.least_loaded(best)

    def _remember(self, blocks: list[int], key: str | None, replica: Replica) -> None:
        index = self._id(replica)
        bit = 1 << index
        memory = self._blocks
        for block in blocks:
            memory[block] = memory.get(block, 0) | bit
            memory.move_to_end(block)
        while len(memory) > self.max_blocks:
            memory.popitem(last=False)
        if key is not None:
            self._keys[key] = index
            self._keys.move_to_end(key)
            if len(self._keys) > self.max_keys:
                self._keys.popitem(last=False)
