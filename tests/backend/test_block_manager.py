"""Block manager: ref-counted sharing, copy-on-write, chained prefix hashes, LRU eviction, and the
bookkeeping invariants after arbitrary operation sequences (hypothesis state machine)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from backend.block_manager import Allocation, BlockManager
from backend.sequence import Sequence
from protocol import SamplingParams

_ids = itertools.count()


def make_seq(prompt, seq_index: int = 0, request_id: str | None = None) -> Sequence:
    seq_id = next(_ids)
    return Sequence(seq_id, request_id or f"r{seq_id}", seq_index, tuple(prompt), SamplingParams(), seq_id)


def prefill(bm: BlockManager, seq: Sequence) -> Allocation:
    """Look up the prefix, allocate and 'compute' the rest of seq's known tokens."""
    seq.num_computed_tokens = bm.match_prefix(seq)
    alloc = bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    assert alloc is not None
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)
    return alloc


def decode(bm: BlockManager, seq: Sequence, token: int) -> Allocation | None:
    seq.append_token(token)
    alloc = bm.allocate(seq, 1)
    if alloc is not None:
        seq.num_computed_tokens += 1
        bm.mark_computed(seq)
    return alloc


def test_allocate_covers_tokens_and_free_returns_everything():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    seq = make_seq(range(10))
    alloc = prefill(bm, seq)
    assert len(alloc.new_blocks) == 3 and alloc.copies == ()
    assert bm.block_table(seq) == alloc.new_blocks
    assert bm.stats().used == 3 and bm.num_free_blocks == 5
    assert decode(bm, seq, 1).new_blocks == ()  # token 10 fits block 2
    assert decode(bm, seq, 2).new_blocks == ()
    assert len(decode(bm, seq, 3).new_blocks) == 1  # token 12 opens block 3
    bm.check_invariants()
    bm.free(seq)
    assert bm.block_table(seq) == ()
    assert bm.stats().used == 0 and bm.stats().cached == 0
    bm.check_invariants()


def test_fork_shares_every_block():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    leader, child = make_seq(range(10)), make_seq(range(10), seq_index=1)
    prefill(bm, leader)
    bm.fork(leader, child)
    child.num_computed_tokens = leader.num_computed_tokens
    assert bm.block_table(child) == bm.block_table(leader)
    assert bm.stats().used == 3  # shared, not duplicated
    bm.check_invariants()
    bm.free(leader)
    assert bm.stats().used == 3  # the child still holds them
    bm.free(child)
    assert bm.stats().used == 0
    bm.check_invariants()


def test_copy_on_write_of_the_shared_partial_last_block():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    leader = make_seq(range(10))  # blocks: [0..3] [4..7] [8, 9, _, _]
    siblings = [make_seq(range(10), seq_index=i) for i in (1, 2)]
    prefill(bm, leader)
    for s in siblings:
        bm.fork(leader, s)
        s.num_computed_tokens = leader.num_computed_tokens
    shared = bm.block_table(leader)

    a = decode(bm, leader, 100)
    assert a.new_blocks == () and len(a.copies) == 1
    src, dst = a.copies[0]
    assert src == shared[2] and dst not in shared
    assert bm.block_table(leader) == (shared[0], shared[1], dst)
    assert bm.block_table(siblings[0]) == shared  # untouched

    b = decode(bm, siblings[0], 200)
    assert len(b.copies) == 1 and b.copies[0][0] == shared[2]
    c = decode(bm, siblings[1], 300)  # the last holder writes in place
    assert c.copies == () and bm.block_table(siblings[1]) == shared
    assert bm.stats().used == 5
    bm.check_invariants()


def test_no_copy_when_the_prompt_ends_on_a_block_boundary():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    leader, child = make_seq(range(8)), make_seq(range(8), seq_index=1)
    prefill(bm, leader)
    bm.fork(leader, child)
    child.num_computed_tokens = 8
    a = decode(bm, leader, 1)
    assert a.copies == () and len(a.new_blocks) == 1
    bm.check_invariants()


def test_allocate_returns_none_and_changes_nothing_when_full():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    leader, child = make_seq(range(10)), make_seq(range(10), seq_index=1)
    prefill(bm, leader)  # 3 blocks, 1 free
    bm.fork(leader, child)
    child.num_computed_tokens = 10
    before = (bm.stats(), bm.block_table(leader), bm.block_table(child))
    # needs a CoW block for block 2 plus blocks 3 and 4: 3 > 1 free
    child.output_token_ids.extend([1] * 7)
    assert bm.allocate(child, 7) is None
    assert (bm.stats(), bm.block_table(leader), bm.block_table(child)) == before
    fresh = make_seq(range(100, 120))
    assert bm.allocate(fresh, 20) is None
    assert bm.block_table(fresh) == () and bm.stats() == before[0]
    bm.check_invariants()


def test_prefix_hit_across_requests_and_never_the_whole_sequence():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = make_seq(range(10))
    prefill(bm, a)
    a_table = bm.block_table(a)
    bm.free(a)
    assert bm.stats().cached == 2  # the two full blocks; the partial one is plain free

    b = make_seq([*range(8), 50, 51, 52])
    assert bm.match_prefix(b) == 8
    assert bm.block_table(b) == a_table[:2]
    assert bm.stats().cached == 0  # taken out of the evictable list

    c = make_seq(range(8))  # every full block hits: the last is given back to be computed
    assert bm.match_prefix(c) == 4
    assert bm.block_table(c) == a_table[:1]

    d = make_seq(range(4))
    assert bm.match_prefix(d) == 0 and bm.block_table(d) == ()

    stats = bm.stats()
    assert stats.prefix_queries == 10 + 11 + 8 + 4
    assert stats.prefix_hits == 8 + 4
    bm.check_invariants()


def test_prefix_hit_on_blocks_still_in_use_shares_them():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a, b = make_seq(range(12)), make_seq([*range(8), 9, 9, 9, 9, 9])
    prefill(bm, a)
    assert bm.match_prefix(b) == 8
    assert bm.block_table(b) == bm.block_table(a)[:2]
    assert bm.stats().used == 3
    bm.check_invariants()


def test_generated_tokens_are_cached_too():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = make_seq(range(6))
    prefill(bm, a)
    for t in (6, 7, 8, 9):
        decode(bm, a, t)
    bm.free(a)
    b = make_seq(range(10))
    assert bm.match_prefix(b) == 8  # the second block was finished by generated tokens


def test_chained_hash_needs_the_same_prefix():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    p1, p2, q, r = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    for prompt in (p1 + q + [0], p2 + r + [0]):
        s = make_seq(prompt)
        prefill(bm, s)
        bm.free(s)
    # p2 hits; q was cached only after p1, so after p2 it must miss
    s = make_seq(p2 + q + [0])
    assert bm.match_prefix(s) == 4
    bm.check_invariants()


def test_cached_free_blocks_are_evicted_lru_after_uncached_ones():
    bm = BlockManager(6, 4, enable_prefix_caching=True)
    a, b = make_seq(range(0, 9)), make_seq(range(100, 109))  # 2 full blocks + 1 partial each
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)  # freed first: least recently used
    bm.free(b)
    assert bm.stats().cached == 4 and bm.num_free_blocks == 6

    filler = make_seq(range(1000, 1012))
    assert bm.allocate(filler, 12) is not None  # 3 blocks: 2 uncached (the partials) + 1 evicted
    assert bm.stats().cached == 3
    probe_a, probe_b = make_seq(range(0, 9)), make_seq(range(100, 109))
    # a's tail block went first (a sequence's tail is evicted before its head)
    assert bm.match_prefix(probe_a) == 4
    assert bm.match_prefix(probe_b) == 8
    bm.free(probe_a)
    bm.free(probe_b)
    bm.free(filler)
    bm.check_invariants()


def test_a_hit_refreshes_the_lru_position():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a, b = make_seq(range(0, 5)), make_seq(range(100, 105))
    for s in (a, b):
        prefill(bm, s)
        bm.free(s)
    # a is older, but a hit and a free make it the most recent
    again = make_seq(range(0, 6))
    assert bm.match_prefix(again) == 4
    bm.free(again)
    filler = make_seq(range(1000, 1012))
    assert bm.allocate(filler, 12) is not None  # 2 uncached + the LRU cached one (b's)
    assert bm.match_prefix(make_seq(range(100, 105))) == 0
    assert bm.match_prefix(make_seq(range(0, 5))) == 4


def test_free_without_cache_forgets_hashes():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = make_seq(range(9))
    prefill(bm, a)
    bm.free(a, cache=False)
    assert bm.stats().cached == 0
    assert bm.match_prefix(make_seq(range(9))) == 0
    bm.check_invariants()


def test_prefix_caching_off_never_hits_nor_counts():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(range(9))
    prefill(bm, a)
    bm.free(a)
    assert bm.match_prefix(make_seq(range(9))) == 0
    assert bm.stats().cached == 0 and bm.stats().prefix_queries == 0


def test_same_tokens_computed_twice_keep_the_first_cached_block():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a, b = make_seq(range(9)), make_seq(range(9))
    for s in (a, b):  # both allocate before either registers (same step)
        assert bm.allocate(s, 9) is not None
    for s in (a, b):
        s.num_computed_tokens = 9
        bm.mark_computed(s)
    bm.check_invariants()
    bm.free(a)
    bm.free(b)
    assert bm.stats().cached == 2
    bm.check_invariants()


# ---- random operations: the invariants hold after anything ---------------------------------

BLOCK = 4
# Prompts from a small alphabet so that prefixes repeat and hit.
prompts = st.lists(st.sampled_from([1, 2, 3]), min_size=1, max_size=14)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(10, BLOCK, enable_prefix_caching=True)
        self.live: list[Sequence] = []  # have blocks or a computed prefix

    @rule(prompt=prompts, chunk=st.integers(1, 16))
    def admit(self, prompt, chunk):
        seq = make_seq(prompt)
        seq.num_computed_tokens = self.bm.match_prefix(seq)
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        if self.bm.allocate(seq, n) is None:
            self.bm.free(seq)
            return
        seq.num_computed_tokens += n
        self.bm.mark_computed(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.sampled_from([1, 2, 3]))
    def step(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)
        n = data.draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens))
        before = (self.bm.stats(), self.bm.block_table(seq))
        alloc = self.bm.allocate(seq, n)
        if alloc is None:
            assert (self.bm.stats(), self.bm.block_table(seq)) == before
            return
        for src, dst in alloc.copies:
            assert src in before[1] and dst in self.bm.block_table(seq)
        seq.num_computed_tokens += n
        self.bm.mark_computed(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        leader = data.draw(st.sampled_from(self.live))
        child = make_seq(leader.prompt_token_ids, seq_index=1)
        child.output_token_ids.extend(leader.output_token_ids)
        self.bm.fork(leader, child)
        child.num_computed_tokens = leader.num_computed_tokens
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), cache=st.booleans(), preempt=st.booleans())
    def free(self, data, cache, preempt):
        seq = data.draw(st.sampled_from(self.live))
        self.bm.free(seq, cache=cache)
        self.live.remove(seq)
        if preempt:  # recompute later: prompt + outputs are looked up again
            seq.num_computed_tokens = 0
            seq.num_computed_tokens = self.bm.match_prefix(seq)
            if self.bm.allocate(seq, 1) is None:
                self.bm.free(seq)
                seq.num_computed_tokens = 0
                return
            seq.num_computed_tokens += 1
            self.bm.mark_computed(seq)
            self.live.append(seq)

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        stats = self.bm.stats()
        assert stats.free + stats.used == stats.total
        for seq in self.live:
            assert len(self.bm.block_table(seq)) * BLOCK >= seq.num_computed_tokens

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.stats().used == 0


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("bad", [(0, 4), (4, 0)])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError):
        BlockManager(*bad, enable_prefix_caching=True)


def test_prefix_blocks_are_shared_only_under_the_same_cache_salt():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)

    def salted(salt):
        seq_id = next(_ids)
        return Sequence(seq_id, f"r{seq_id}", 0, tuple(range(9)), SamplingParams(cache_salt=salt), seq_id)

    prefill(bm, salted("alice"))
    for salt, hit in (("alice", 8), ("bob", 0), (None, 0)):
        assert bm.match_prefix(salted(salt)) == hit, salt


def test_block_digests_are_keyed_and_chain_their_parent():
    import hashlib
    import struct

    from backend.block_manager import block_hash

    first = block_hash(None, (1, 2, 3, 4))
    assert isinstance(first, bytes) and first != block_hash(None, (1, 2, 3, 4), "salt")
    assert block_hash(first, (5, 6, 7, 8)) != block_hash(None, (5, 6, 7, 8))
    unkeyed = hashlib.blake2b(b"salt:" + struct.pack("<4q", 1, 2, 3, 4), digest_size=16).digest()
    assert first != unkeyed  # (the process's secret key is in it)
