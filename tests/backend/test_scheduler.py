"""Scheduler with a fake model runner.

The fake runner keeps a fake KV cache (one token id per slot), applies the copy-on-write copies,
writes every scheduled token into the slot its block table names, then reads each sequence's whole
context back through its block table: that must equal the sequence's tokens (so prefix hits, forks,
copies and preemptions never hand a sequence someone else's KV). The next token is a deterministic
function of the context read from the cache and the sequence index, so any run, however it was
chunked, preempted or batched, must produce exactly the tokens of `reference_output`.
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.block_manager import BlockManager
from backend.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from backend.sequence import Sequence, SequenceStatus
from protocol import SamplingParams

VOCAB = 50


def next_token(context: tuple[int, ...], seq_index: int) -> int:
    h = seq_index + 1
    for t in context:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return h % VOCAB


def reference_output(prompt: tuple[int, ...], seq_index: int, max_tokens: int, max_model_len: int) -> list[int]:
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens and len(tokens) < max_model_len:
        tokens.append(next_token(tuple(tokens), seq_index))
    return tokens[len(prompt) :]


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]

    def run(self, out: SchedulerOutput) -> dict[Sequence, int]:
        for src, dst in out.blocks_to_copy:
            self.kv[dst] = list(self.kv[src])
        for e in out.scheduled:  # store every token's K/V first, as each layer does
            for k, token in enumerate(e.token_ids):
                pos = e.start_position + k
                self.kv[e.block_table[pos // self.bs]][pos % self.bs] = token
        sampled: dict[Sequence, int] = {}
        for e in out.scheduled:  # then attend
            end = e.start_position + e.num_new_tokens
            context = tuple(self.kv[e.block_table[p // self.bs]][p % self.bs] for p in range(end))
            assert context == e.seq.token_slice(0, end), f"wrong KV for {e.seq}"
            if e.samples:
                for s in (e.seq, *e.forked):
                    sampled[s] = next_token(context, s.seq_index)
        return sampled


@dataclass(frozen=True)
class Req:
    request_id: str
    prompt: tuple[int, ...]
    n: int = 1
    max_tokens: int = 8
    at_step: int = 0  # the step before which it arrives


_seq_ids = itertools.count()


def make_seqs(req: Req, arrival: int) -> list[Sequence]:
    params = SamplingParams(n=req.n, max_tokens=req.max_tokens)
    return [Sequence(next(_seq_ids), req.request_id, i, req.prompt, params, arrival) for i in range(req.n)]


class Harness:
    """Scheduler + block manager + fake runner + the engine's post-step bookkeeping."""

    def __init__(self, *, num_blocks=64, block_size=4, max_num_seqs=8, budget=16, max_model_len=64, prefix=True):
        self.config = SchedulerConfig(max_num_seqs, budget, max_model_len, block_size)
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
        self.sched = Scheduler(self.config, self.bm)
        self.runner = FakeRunner(num_blocks, block_size)
        self.seqs: dict[tuple[str, int], Sequence] = {}
        self.arrivals = itertools.count()
        self.finished_at: dict[tuple[str, int], int] = {}
        self.steps = 0

    def add(self, req: Req) -> list[Sequence]:
        seqs = make_seqs(req, next(self.arrivals))
        for s in seqs:
            self.seqs[(req.request_id, s.seq_index)] = s
        self.sched.add_request(seqs)
        return seqs

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.check(out)
        for seq, token in self.runner.run(out).items():
            seq.append_token(token)
            if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.config.max_model_len:
                self.sched.finish(seq)
                self.finished_at[(seq.request_id, seq.seq_index)] = self.steps
        self.bm.check_invariants()
        self.steps += 1
        return out

    def check(self, out: SchedulerOutput) -> None:
        cfg = self.config
        assert out.total_tokens == sum(e.num_new_tokens for e in out.scheduled) <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs and self.sched.num_running <= cfg.max_num_seqs
        assert len({e.seq.seq_id for e in out.scheduled}) == len(out.scheduled)
        assert [e.num_new_tokens for e in out.scheduled[: out.num_decode_seqs]] == [1] * out.num_decode_seqs
        assert all(e.num_new_tokens > 1 for e in out.scheduled[out.num_decode_seqs :])
        for e in out.scheduled:
            assert e.seq.status is SequenceStatus.RUNNING
            assert e.samples == (e.start_position + e.num_new_tokens == e.seq.num_tokens)
            assert e.seq.num_tokens <= cfg.max_model_len
        self.bm.check_invariants()

    def run(self, reqs: list[Req], max_steps: int = 10_000) -> dict[tuple[str, int], list[int]]:
        pending = sorted(reqs, key=lambda r: r.at_step)
        while pending or self.sched.has_unfinished():
            while pending and pending[0].at_step <= self.steps:
                self.add(pending.pop(0))
            self.step()
            assert self.steps < max_steps, "no progress"
        assert self.bm.stats().used == 0
        assert self.sched.num_running == self.sched.num_waiting == 0
        return {key: list(s.output_token_ids) for key, s in self.seqs.items()}


def expected(reqs: list[Req], max_model_len: int) -> dict[tuple[str, int], list[int]]:
    return {
        (r.request_id, i): reference_output(r.prompt, i, r.max_tokens, max_model_len) for r in reqs for i in range(r.n)
    }


def prompt(length: int, salt: int = 0) -> tuple[int, ...]:
    return tuple((salt * 7 + i * 3) % VOCAB for i in range(length))


# ---- tests -------------------------------------------------------------------------------------


def test_chunked_prefill_interleaves_with_running_decodes():
    h = Harness(budget=16, max_model_len=128, num_blocks=64)
    h.add(Req("a", prompt(3, 1), max_tokens=20))
    h.add(Req("b", prompt(3, 2), max_tokens=20))
    first = h.step()
    assert [e.num_new_tokens for e in first.scheduled] == [3, 3] and all(e.samples for e in first.scheduled)

    (long,) = h.add(Req("long", prompt(40, 3), max_tokens=4))
    chunks = []
    for _ in range(3):
        out = h.step()
        assert out.num_decode_seqs == 2  # the decodes keep going, one token each
        assert [e.seq.request_id for e in out.scheduled[:2]] == ["a", "b"]
        (e,) = out.scheduled[2:]
        assert e.seq is long
        chunks.append((e.start_position, e.num_new_tokens, e.samples))
    assert chunks == [(0, 14, False), (14, 14, False), (28, 12, True)]
    assert long.num_output_tokens == 1
    out = h.step()
    assert out.num_decode_seqs == 3 and out.total_tokens == 3


def test_budget_smaller_than_a_prompt_still_completes():
    h = Harness(budget=5, max_model_len=64, num_blocks=32)
    reqs = [Req("a", prompt(23, 1), max_tokens=5), Req("b", prompt(11, 2), max_tokens=7)]
    assert h.run(reqs) == expected(reqs, 64)


def test_fcfs_and_seat_limit():
    h = Harness(max_num_seqs=2, budget=64, num_blocks=64)
    for i in range(4):
        h.add(Req(f"r{i}", prompt(5, i), max_tokens=3))
    out = h.step()
    assert [e.seq.request_id for e in out.scheduled] == ["r0", "r1"]
    assert h.sched.num_running == 2 and h.sched.num_waiting == 2


def test_n_seats_are_reserved_at_admission():
    h = Harness(max_num_seqs=3, budget=16, num_blocks=64)
    h.add(Req("fork", prompt(30, 1), n=3, max_tokens=2))
    h.add(Req("other", prompt(2, 2), max_tokens=2))
    out = h.step()  # the leader is still prefilling: its siblings' seats are taken
    assert [e.seq.request_id for e in out.scheduled] == ["fork"]
    assert h.sched.num_running == 1 and h.sched.num_waiting == 1
    out = h.step()  # it catches up and forks; "other" still has no seat
    assert [(e.seq.request_id, len(e.forked)) for e in out.scheduled] == [("fork", 2)]
    assert h.sched.num_running == 3 and h.sched.num_waiting == 1


def test_fork_shares_prompt_blocks_and_siblings_run_independently():
    h = Harness(budget=64, num_blocks=64)
    req = Req("r", prompt(10, 5), n=3, max_tokens=6)
    leader, s1, s2 = h.add(req)
    assert (s1.status, s2.status) == (SequenceStatus.FORK_PENDING, SequenceStatus.FORK_PENDING)

    out = h.step()
    (e,) = out.scheduled
    assert e.seq is leader and e.samples and e.forked == (s1, s2)
    tables = [h.bm.block_table(s) for s in (leader, s1, s2)]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3  # 10 tokens in blocks of 4
    assert h.bm.stats().used == 3
    assert len({leader.output_token_ids[0], s1.output_token_ids[0], s2.output_token_ids[0]}) == 3

    out = h.step()  # each writes token 10 into the shared partial block: two copies, the last in place
    assert out.num_decode_seqs == 3 and len(out.blocks_to_copy) == 2
    assert {src for src, _ in out.blocks_to_copy} == {tables[0][2]}
    after = [h.bm.block_table(s) for s in (leader, s1, s2)]
    assert all(t[:2] == tables[0][:2] for t in after)  # the full prompt blocks stay shared
    assert len({t[2] for t in after}) == 3

    outputs = h.run([])
    assert outputs == expected([req], h.config.max_model_len)
    assert len({tuple(v) for v in outputs.values()}) == 3


def test_fork_after_chunked_prefill():
    h = Harness(budget=8, num_blocks=64)
    req = Req("r", prompt(21, 2), n=3, max_tokens=5)
    h.add(req)
    forks = []
    while h.sched.has_unfinished():
        out = h.step()
        forks += [len(e.forked) for e in out.scheduled if e.forked]
    assert forks == [2]
    assert {k: list(s.output_token_ids) for k, s in h.seqs.items()} == expected([req], 64)


def test_preemption_resumes_to_the_same_tokens():
    reqs = [Req(f"r{i}", prompt(6 + 3 * i, i), n=1 + i % 2, max_tokens=12, at_step=i) for i in range(6)]
    tiny = Harness(num_blocks=16, block_size=4, budget=32, max_model_len=64, prefix=False)
    assert tiny.run(reqs) == expected(reqs, 64)
    assert tiny.sched.num_preemptions > 0


def test_preempted_seq_goes_back_to_the_front_and_keeps_its_outputs():
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=2, budget=64, max_model_len=64, prefix=False)
    a, b = h.add(Req("a", prompt(20, 1), max_tokens=30))[0], h.add(Req("b", prompt(20, 2), max_tokens=30))[0]
    (c,) = h.add(Req("c", prompt(3, 3), max_tokens=2))
    preempted = None
    for _ in range(40):
        out = h.step()
        if out.preempted:
            preempted = out.preempted
            break
    assert preempted == (b,)  # the latest-arrived running seq
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.num_output_tokens > 0
    assert h.bm.block_table(b) == ()
    assert list(h.sched._waiting) == [b, c]  # ahead of c, which had no seat
    assert not any(e.seq is b for e in out.scheduled)
    outputs = h.run([])
    assert outputs[("b", 0)] == reference_output(b.prompt_token_ids, 0, 30, 64)
    assert outputs[("a", 0)] == reference_output(a.prompt_token_ids, 0, 30, 64)


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_match_the_reference(seed, prefix):
    rng = random.Random(seed)
    shared = prompt(12, 99)  # a common system prompt, so prefixes hit
    reqs = []
    for i in range(10):
        body = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 20)))
        reqs.append(
            Req(
                f"r{i}",
                (shared + body) if rng.random() < 0.5 else body,
                n=rng.choice([1, 1, 2, 3]),
                max_tokens=rng.randint(1, 12),
                at_step=rng.randint(0, 15),
            )
        )
    max_model_len = 40
    h = Harness(num_blocks=12, block_size=4, max_num_seqs=4, budget=16, max_model_len=max_model_len, prefix=prefix)
    assert h.run(reqs) == expected(reqs, max_model_len)


def test_prefix_hit_skips_computed_tokens():
    h = Harness(budget=64, num_blocks=64)
    p = prompt(20, 4)
    h.run([Req("a", p, max_tokens=3)])
    (b,) = h.add(Req("b", p, max_tokens=3))
    out = h.step()
    (e,) = out.scheduled
    assert e.seq is b and e.start_position == 16 and e.num_new_tokens == 4  # all 5 blocks hit: the last is recomputed
    assert h.bm.stats().prefix_hits == 16
    (c,) = h.add(Req("c", p + (1, 2, 3, 4, 5), max_tokens=3))
    out = h.step()
    (e,) = [e for e in out.scheduled if e.seq is c]
    assert e.start_position == 20  # a computed 22 tokens (its last sampled token never is): 5 full blocks
    h.run([])
    assert [h.seqs[(r, 0)].num_cached_tokens for r in "abc"] == [0, 16, 20]


def test_cached_tokens_are_those_of_the_first_admission_shared_by_forked_siblings():
    h = Harness(budget=64, num_blocks=64)
    p = prompt(12, 7)
    h.run([Req("a", p, max_tokens=2)])
    leader, sibling = h.add(Req("n2", p + (9,), n=2, max_tokens=2))
    params = SamplingParams(max_tokens=2, prompt_logprobs=0)
    scoring = Sequence(next(_seq_ids), "scores", 0, p + (9,), params, next(h.arrivals))
    h.sched.add_request([scoring])
    h.run([])
    assert (leader.num_cached_tokens, sibling.num_cached_tokens) == (12, 12)
    assert scoring.num_cached_tokens == 0  # it computes every prompt position for their logits


def test_a_readmission_after_preemption_keeps_the_first_cached_count():
    h = Harness(num_blocks=16, block_size=4, max_num_seqs=2, budget=64, max_model_len=64)
    h.add(Req("a", prompt(20, 1), max_tokens=30))
    (b,) = h.add(Req("b", prompt(20, 2), max_tokens=30))
    while not h.step().preempted:
        pass
    assert b.status is SequenceStatus.WAITING and b.num_cached_tokens == 0
    hits = h.bm.stats().prefix_hits
    h.run([])
    assert h.bm.stats().prefix_hits > hits  # b found its own blocks again ...
    assert b.num_cached_tokens == 0  # ... which its prompt did not


def test_abort_frees_blocks_at_once():
    h = Harness(budget=64, num_blocks=64)
    keep = h.add(Req("keep", prompt(5, 1), max_tokens=50))
    gone = h.add(Req("gone", prompt(9, 2), n=2, max_tokens=50))
    h.step()
    h.step()
    used_before = h.bm.stats().used
    aborted = h.sched.abort_request("gone")
    assert set(aborted) == set(gone) and all(s.is_finished for s in gone)
    assert h.bm.stats().used == used_before - 4  # 2 shared prompt blocks + 1 own block each
    assert h.bm.stats().used == len(h.bm.block_table(keep[0]))
    assert h.sched.abort_request("gone") == []
    assert h.sched.abort_request("nope") == []
    h.sched.abort_request("keep")
    assert not h.sched.has_unfinished() and h.bm.stats().used == 0
    h.bm.check_invariants()


def test_abort_before_fork_ends_pending_siblings_and_waiting_requests():
    h = Harness(budget=8, max_num_seqs=3, num_blocks=64)
    seqs = h.add(Req("fork", prompt(30, 1), n=3))
    (waiting,) = h.add(Req("waiting", prompt(4, 2)))
    h.step()  # leader mid-prefill, siblings pending, the other request waiting for seats
    assert seqs[0].status is SequenceStatus.RUNNING and h.bm.block_table(seqs[0])
    assert h.sched.abort_request("fork") == seqs
    assert all(s.is_finished for s in seqs) and h.bm.stats().used == 0
    assert h.sched.abort_request("waiting") == [waiting]
    assert h.sched.num_waiting == 0 and not h.sched.has_unfinished()
    h.bm.check_invariants()


def test_finish_without_cache_forgets_the_blocks():
    h = Harness(budget=64, num_blocks=64)
    (a,) = h.add(Req("a", prompt(20, 1)))
    h.step()
    h.sched.finish(a, cache=False)
    assert h.bm.stats().cached == 0 and h.bm.stats().used == 0
    (b,) = h.add(Req("b", prompt(20, 1)))
    (e,) = h.step().scheduled
    assert e.start_position == 0


def test_limits_are_asserted():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=32, block_size=4)
    with pytest.raises(ValueError):
        Scheduler(config, BlockManager(7, 4, enable_prefix_caching=True))  # 28 slots < 32
    with pytest.raises(ValueError):
        Scheduler(config, BlockManager(8, 8, enable_prefix_caching=True))  # block sizes differ
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=16, max_model_len=32, block_size=4)
    sched = Scheduler(config, BlockManager(8, 4, enable_prefix_caching=True))
    with pytest.raises(AssertionError):
        sched.add_request(make_seqs(Req("long", prompt(33)), 0))
    with pytest.raises(AssertionError):
        sched.add_request(make_seqs(Req("wide", prompt(3), n=3), 0))


@pytest.mark.parametrize("seed", range(4))
def test_random_aborts_leave_no_blocks_and_the_rest_unchanged(seed):
    rng = random.Random(100 + seed)
    reqs = [
        Req(
            f"r{i}",
            prompt(rng.randint(1, 30), i % 3),
            n=rng.choice([1, 2, 3]),
            max_tokens=rng.randint(1, 10),
            at_step=rng.randint(0, 10),
        )
        for i in range(10)
    ]
    aborts = {rng.randint(0, 25): f"r{rng.randrange(10)}" for _ in range(4)}  # step -> request id
    h = Harness(num_blocks=12, block_size=4, max_num_seqs=4, budget=12, max_model_len=40)
    pending = sorted(reqs, key=lambda r: r.at_step)
    aborted: set[str] = set()
    while pending or h.sched.has_unfinished():
        while pending and pending[0].at_step <= h.steps:
            h.add(pending.pop(0))
        if h.steps in aborts and aborts[h.steps] in {s.request_id for s in h.seqs.values()}:
            rid = aborts[h.steps]
            done = h.sched.abort_request(rid)
            assert all(s.is_finished and h.bm.block_table(s) == () for s in done)
            h.bm.check_invariants()
            aborted.add(rid)
        h.step()
        assert h.steps < 1000
    assert h.bm.stats().used == 0
    want = expected(reqs, 40)
    for key, seq in h.seqs.items():
        got = list(seq.output_token_ids)
        if key[0] in aborted:
            assert got == want[key][: len(got)]
        else:
            assert got == want[key]


def test_the_scheduling_modules_do_not_import_torch():
    code = "import sys, backend.scheduler, backend.block_manager, backend.sequence; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
