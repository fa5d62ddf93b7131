"""Paged KV-cache memory: ref-counted blocks, per-sequence block tables, prefix caching.

The pool has `num_blocks` blocks of `block_size` token slots. Each sequence's block table (kept
here, keyed by seq_id) lists the blocks that hold its tokens in order: token i lives in
table[i // block_size] at offset i % block_size. A block may be in several tables (n > 1 siblings
share the prompt after a fork; requests share a cached prefix); its ref count is the number of
tables it is in. The free lists are private: callers ask `allocate`, which either succeeds whole
or returns None and changes nothing.

Copy-on-write: a token is only ever written into a block that this sequence alone holds. When the
next write would land in a shared block (the partial last block of forked siblings), `allocate`
gives the sequence a fresh block and reports (src, dst); the model runner copies those KV rows
before the forward pass, in the listed order.

Prefix caching: once a block is full and computed, it is registered under a chained digest of
(the parent block's digest, the block's token ids), the first block's parent being the request's
cache salt, so the same tokens after a different prefix, or under another salt, never match. The
digest is BLAKE2b keyed with a secret made at start: a client cannot craft two prefixes that collide
(and so read KV computed for another's tokens), as it could with Python's unkeyed `hash`. A freed
block keeps its digest and stays findable until the pool needs it: uncached free blocks are handed
out first, then cached ones are evicted least recently freed first.

Hashes are registered at schedule time, before the forward pass that writes the block. A sequence
admitted in the same step may hit them: that is safe because every layer stores the whole batch's
K/V before it runs attention. If the forward pass fails, `free(seq, cache=False)` drops them.

No torch here.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass

from backend.sequence import Sequence

BlockHash = bytes
_DIGEST_KEY = secrets.token_bytes(32)  # one per process: digests are neither predictable nor comparable


def block_hash(parent: BlockHash | None, tokens: tuple[int, ...], cache_salt: str | None = None) -> BlockHash:
    """The digest a full block is cached under: its parent's (or, for a first block, the salt) and its tokens."""
    digest = hashlib.blake2b(key=_DIGEST_KEY, digest_size=16)
    digest.update(parent if parent is not None else b"salt:" + (cache_salt or "").encode())
    digest.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return digest.digest()


@dataclass(frozen=True, slots=True)
class Allocation:
    """What one successful `allocate` did to a sequence's table."""

    new_blocks: tuple[int, ...]  # appended to the end of the table
    copies: tuple[tuple[int, int], ...]  # copy-on-write (src, dst): dst replaced src in the table


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """Block counts, and prefix-cache lookups counted in tokens (as vLLM's prefix-cache metrics)."""

    total: int  # blocks in the pool
    used: int  # blocks in at least one block table
    free: int  # blocks allocatable, cached ones included
    cached: int  # free blocks still findable by prefix lookup
    prefix_queries: int  # tokens of the sequences looked up (only with prefix caching on)
    prefix_hits: int  # tokens of those that were found cached

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def usage(self) -> float:
        return self.used / self.total


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # digest -> block holding those tokens
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._tables: dict[int, list[int]] = {}  # seq_id -> block ids
        self._seq_hashes: dict[int, list[BlockHash]] = {}  # seq_id -> chained digests of its computed full blocks
        self._query_tokens = 0
        self._hit_tokens = 0

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    def block_table(self, seq: Sequence) -> tuple[int, ...]:
        return tuple(self._tables.get(seq.seq_id, ()))

    def stats(self) -> KVCacheStats:
        free = self.num_free_blocks
        return KVCacheStats(
            total=self.num_blocks,
            used=self.num_blocks - free,
            free=free,
            cached=len(self._free_cached),
            prefix_queries=self._query_tokens,
            prefix_hits=self._hit_tokens,
        )

    # ---- changes -------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int) -> Allocation | None:
        """Make seq's blocks cover num_computed_tokens + num_new_tokens tokens, each block about
        to be written owned by seq alone. None (and nothing changed) if the pool is too small."""
        assert num_new_tokens >= 0
        bs = self.block_size
        table = self._tables.get(seq.seq_id, [])
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        needed = _cdiv(end, bs)
        assert len(table) >= _cdiv(start, bs), "computed tokens without blocks"
        num_append = max(0, needed - len(table))
        shared = []
        if num_new_tokens > 0:
            shared = [i for i in range(start // bs, min(len(table), needed)) if self._ref[table[i]] > 1]
        if num_append + len(shared) > self.num_free_blocks:
            return None
        copies = []
        for i in shared:
            src, dst = table[i], self._take()
            self._ref[src] -= 1  # still >= 1: the other sharers keep it
            table[i] = dst
            copies.append((src, dst))
        new_blocks = tuple(self._take() for _ in range(num_append))
        table.extend(new_blocks)
        if table:
            self._tables[seq.seq_id] = table
        return Allocation(new_blocks=new_blocks, copies=tuple(copies))

    def match_prefix(self, seq: Sequence) -> int:
        """For a seq with no blocks: take the longest run of cached full blocks of its known tokens
        and return how many tokens they cover. Never all of them: the last token must be computed
        for the model to give logits, so a hit on every full block gives the last one back."""
        assert seq.seq_id not in self._tables and seq.num_computed_tokens == 0, "match_prefix on a seq with blocks"
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        hits: list[int] = []
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(seq.num_tokens // bs):
            h = block_hash(parent, seq.token_slice(i * bs, (i + 1) * bs), seq.params.cache_salt)
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        if hits and len(hits) * bs == seq.num_tokens:
            hits.pop()
            hashes.pop()
        for block in hits:
            if self._ref[block] == 0:
                del self._free_cached[block]
            self._ref[block] += 1
        if hits:
            self._tables[seq.seq_id] = hits
            self._seq_hashes[seq.seq_id] = hashes
        self._query_tokens += seq.num_tokens
        self._hit_tokens += len(hits) * bs
        return len(hits) * bs

    def mark_computed(self, seq: Sequence) -> None:
        """Register the hashes of seq's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        hashes = self._seq_hashes.get(seq.seq_id, [])
        if num_full <= len(hashes):
            return
        table = self._tables[seq.seq_id]
        assert num_full <= len(table)
        self._seq_hashes[seq.seq_id] = hashes
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_full):
            h = block_hash(parent, seq.token_slice(i * bs, (i + 1) * bs), seq.params.cache_salt)
            hashes.append(h)
            parent = h
            block = table[i]
            assert self._hash[block] in (None, h)
            if self._hash[block] is None and h not in self._cached:
                # If another block already holds these tokens (both computed in the same step), keep
                # the first: this one stays uncached and goes back to the pool as plain free.
                self._hash[block] = h
                self._cached[h] = block

    def fork(self, leader: Sequence, child: Sequence) -> None:
        """child shares every block of leader (ref++ each)."""
        assert child.seq_id not in self._tables, "fork into a seq that has blocks"
        table = list(self._tables.get(leader.seq_id, ()))
        for block in table:
            self._ref[block] += 1
        if table:
            self._tables[child.seq_id] = table
        if leader.seq_id in self._seq_hashes:
            self._seq_hashes[child.seq_id] = list(self._seq_hashes[leader.seq_id])

    def free(self, seq: Sequence, cache: bool = True) -> None:
        """Drop seq's blocks (ref-- each). A block at ref 0 returns to the pool, still findable by
        prefix lookup if it has a hash. cache=False forgets the hashes of all seq's blocks (their
        KV content is not to be trusted, e.g. the forward pass failed)."""
        table = self._tables.pop(seq.seq_id, None)
        self._seq_hashes.pop(seq.seq_id, None)
        if table is None:
            return
        for block in reversed(table):  # the tail of a sequence is evicted before its head
            if not cache:
                self._uncache(block)
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._hash[block] is not None:
                    self._free_cached[block] = None
                else:
                    self._free_uncached.append(block)

    # ---- internals -----------------------------------------------------------------------

    def _take(self) -> int:
        if self._free_uncached:
            block = self._free_uncached.popleft()
        else:
            block, _ = self._free_cached.popitem(last=False)  # evict the least recently freed
            self._uncache(block)
        assert self._ref[block] == 0
        self._ref[block] = 1
        return block

    def _uncache(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            del self._cached[h]
            self._hash[block] = None

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        counts = [0] * self.num_blocks
        for table in self._tables.values():
            assert len(set(table)) == len(table), "a block twice in one table"
            for block in table:
                counts[block] += 1
        assert counts == self._ref, "ref counts differ from table entries"
        assert sum(self._ref) == sum(len(t) for t in self._tables.values())
        uncached, cached = set(self._free_uncached), set(self._free_cached)
        assert len(uncached) == len(self._free_uncached), "a block twice in the free list"
        assert not (uncached & cached), "a block in both free lists"
        free = uncached | cached
        assert all(self._ref[b] == 0 for b in free), "a block both free and referenced"
        assert len(free) == sum(1 for r in self._ref if r == 0), "a leaked block"
        assert self.num_free_blocks + sum(1 for r in self._ref if r > 0) == self.num_blocks
        assert all(self._hash[b] is not None for b in cached)
        assert all(self._hash[b] is None for b in uncached)
        assert all(self._hash[b] == h for h, b in self._cached.items())
        assert sum(1 for h in self._hash if h is not None) == len(self._cached)
        assert set(self._seq_hashes) <= set(self._tables), "hashes kept for a seq without blocks"
