"""Scheduler: policy unit tests and a hypothesis state machine over add / step / abort / finish.

The machine runs the real Scheduler and BlockManager against a fake model: a step writes, for every
scheduled token, the exact prefix it was computed from into a fake KV cache (see helpers/scheduling.py)
and "samples" the next token as a function of the prefix read back from that cache. So a sequence's
output depends on its KV being right, and outputs after preemptions must equal the no-preemption
reference computed straight from the prompt.
"""

from __future__ import annotations

from helpers.scheduling import FakeKV, Scheduled, execute, make_seq, next_token, prompts, schedule
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tachyllm.config import SchedulerConfig
from tachyllm.core.block_manager import NULL_BLOCK, BlockManager, cdiv
from tachyllm.core.scheduler import Scheduler
from tachyllm.core.sequence import Sequence, SequenceStatus
from tachyllm.outputs import StepStats


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tuple(tokens)))
    return tokens[len(prompt) :]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(2, 10),
        block_size=st.integers(1, 3),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 10),
        chunked=st.booleans(),
        caching=st.booleans(),
        window=st.one_of(st.none(), st.integers(1, 6)),
        window_spare=st.integers(0, 6),
    )
    def setup(self, num_blocks, block_size, max_num_seqs, budget, chunked, caching, window, window_spare) -> None:
        """With a window, the sliding-window layers' pool: what one sequence alone needs at most
        (runner/kv_cache.py's rule for one sequence), and window_spare blocks more."""
        window_blocks = 0
        if window:
            window_blocks = 1 + cdiv(window, block_size) + 2 + cdiv(budget, block_size) + window_spare
        self.bm = BlockManager(num_blocks, block_size, caching, window=window, window_blocks=window_blocks)
        self.stats = StepStats()
        limits = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked
        )
        self.sched = Scheduler(self.bm, limits, self.stats)
        self.kv = FakeKV(num_blocks, block_size)
        self.window_kv = FakeKV(window_blocks, block_size, window) if window else None
        self.live: list[Sequence] = []
        self.completed: list[Sequence] = []
        self.clock = 0

    @rule(tokens=prompts, max_tokens=st.integers(1, 6), priority=st.integers(0, 2))
    def add(self, tokens: list[int], max_tokens: int, priority: int) -> None:
        # The engine's admission rules: what could never run is rejected, everything else waits.
        if self.bm.blocks_needed(len(tokens) + max_tokens) > self.bm.num_blocks:
            return
        if not self.sched.enable_chunked_prefill and len(tokens) > self.sched.max_num_batched_tokens:
            return
        self.clock += 1
        seq = make_seq(tokens, priority, arrival=self.clock, max_tokens=max_tokens)
        self.sched.add(seq)
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule()
    def step(self) -> None:
        sched = self.sched
        decodes = [s for s in sched.running if s.num_uncomputed_tokens == 1]
        out = schedule(sched)
        assert not out.empty, "unfinished sequences but nothing scheduled"
        assert out.num_batched_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        scheduled = [s.seq for s in out.scheduled]
        assert len(set(map(id, scheduled))) == len(scheduled)
        assert all(s.status is SequenceStatus.RUNNING and s in sched.running for s in scheduled)
        assert all(s.num_new_tokens >= 1 for s in out.scheduled)
        for victim in out.preempted:
            assert victim.status is SequenceStatus.WAITING and victim not in scheduled
            assert victim.block_table == [] and victim.num_computed_tokens == 0
            # Preemption takes the lowest-priority, latest-arrived running sequence.
            assert all(s.arrival_order < victim.arrival_order for s in sched.running)
        if any(s not in decodes for s in scheduled):  # a prefill ran: every decode was served first
            assert all(s in scheduled or s in out.preempted for s in decodes)
        for seq in execute(sched, out, self.kv, window_kv=self.window_kv):
            self.live.remove(seq)
            self.completed.append(seq)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(0, 100), reason=st.sampled_from(["abort", "stop"]))
    def end(self, index: int, reason: str) -> None:
        """Abort (at any stage) or a stop condition: the sequence's blocks are free right away."""
        seq = self.live.pop(index % len(self.live))
        self.sched.finish(seq, reason)
        assert seq.is_finished and seq.finish_reason == reason and seq.block_table == []
        assert seq not in self.sched.running and seq not in self.sched.waiting

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "sched"):
            return
        sched, bm = self.sched, self.bm
        assert {id(s) for s in self.live} == {id(s) for s in sched.running + sched.waiting}
        assert sched.waiting == sorted(sched.waiting, key=lambda s: s.arrival_order)
        assert all(s.block_table == [] and s.num_computed_tokens == 0 for s in sched.waiting)
        bm.check_invariants(sched.running + sched.waiting)
        referenced = {b for s in sched.running for b in s.block_table}
        assert len(referenced) + bm.num_free_blocks == bm.num_blocks
        referenced = {b for s in sched.running for b in s.window_block_table} - {NULL_BLOCK}
        assert len(referenced) + bm.num_free_window_blocks == bm.num_window_blocks

    def teardown(self) -> None:
        if not hasattr(self, "sched"):
            return
        for _ in range(1000):  # drain: everything still queued finishes, no livelock
            if not self.live:
                break
            self.step()
        assert not self.live and self.sched.num_unfinished == 0
        for seq in self.completed:  # preemption and prefix hits never change what was generated
            assert seq.output_token_ids == reference_output(
                seq.token_ids[: seq.num_prompt_tokens], seq.params.max_tokens
            )
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.num_free_window_blocks == self.bm.num_window_blocks


def test_scheduler_state_machine():
    run_state_machine_as_test(
        SchedulerMachine,
        settings=settings(
            max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.filter_too_much]
        ),
    )


# -- policy unit tests -------------------------------------------------------------------------


def make_scheduler(
    num_blocks: int, block_size: int, budget: int, chunked: bool = True, caching: bool = True, max_num_seqs: int = 8
):
    bm = BlockManager(num_blocks, block_size, caching)
    limits = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    return Scheduler(bm, limits, StepStats())


def step(sched: Scheduler) -> Scheduled:
    out = schedule(sched)
    execute(sched, out)
    return out


def test_priority_then_arrival_order():
    sched = make_scheduler(64, 4, 64, max_num_seqs=1)
    seqs = [make_seq([1, 2, 3], priority=p, arrival=t, max_tokens=1) for t, p in enumerate([1, 0, 1, 0])]
    for seq in seqs:
        sched.add(seq)
    order = []
    while sched.num_unfinished:
        order += [s.seq for s in step(sched).scheduled]
    assert order == [seqs[1], seqs[3], seqs[0], seqs[2]]


def test_decodes_first_then_prefill_chunks_fill_the_budget():
    sched = make_scheduler(64, 4, 8)
    a = make_seq([1, 2, 3], arrival=0, max_tokens=5)
    sched.add(a)
    step(sched)
    b = make_seq(list(range(20)), arrival=1)
    sched.add(b)
    out = step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 7)]
    out = step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 7)]
    assert b.num_computed_tokens == 14


def test_unchunked_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(64, 4, 8, chunked=False)
    a = make_seq([1, 2, 3], arrival=0, max_tokens=3)
    sched.add(a)
    step(sched)
    b = make_seq(list(range(8)), arrival=1, max_tokens=1)
    sched.add(b)
    while a.status is SequenceStatus.RUNNING:
        assert [s.seq for s in step(sched).scheduled] == [a]  # 1 decode + 8 prompt tokens > 8
    assert [(s.seq, s.num_new_tokens) for s in step(sched).scheduled] == [(b, 8)]


def test_preemption_victim_is_lowest_priority_even_if_already_scheduled():
    """A low-priority decode was scheduled first (decodes go first); a high-priority prefill chunk
    then needs its block. The decode is unscheduled and preempted, not the prefill."""
    sched = make_scheduler(4, 2, 4)
    low = make_seq([1, 2], priority=1, arrival=0)
    sched.add(low)
    step(sched)
    high = make_seq([3, 4, 5, 6, 7, 8], priority=0, arrival=1)
    sched.add(high)
    out = step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(low, 1), (high, 3)]
    assert sched.block_manager.num_free_blocks == 0
    out = step(sched)
    assert out.preempted == [low] and [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(high, 3)]
    assert sched.waiting == [low] and sched.stats.num_preemptions == 1


def test_preempted_sequence_resumes_first_with_its_tokens():
    sched = make_scheduler(6, 2, 16, caching=False, max_num_seqs=2)
    prompts_ = [[1, 1, 1], [2, 2, 2], [0, 0, 0]]
    a, b, late = (make_seq(p, arrival=t, max_tokens=8) for t, p in enumerate(prompts_))
    for seq in (a, b, late):
        sched.add(seq)
    while not (out := step(sched)).preempted:
        pass
    assert out.preempted == [b] and sched.waiting == [b, late]  # back in front of the later arrival
    assert b.num_output_tokens > 0 and b.num_computed_tokens == 0
    tokens_at_preemption = b.num_tokens
    while b.status is SequenceStatus.WAITING:
        out = step(sched)
        assert late.status is SequenceStatus.WAITING or b.status is not SequenceStatus.WAITING
    # Recomputed from prompt + generated tokens in one go.
    assert (out.scheduled[0].seq, out.scheduled[0].num_new_tokens) == (b, tokens_at_preemption)
    while sched.num_unfinished:
        step(sched)
    for seq, prompt in zip((a, b, late), prompts_):
        assert seq.output_token_ids == reference_output(prompt, 8)


def test_unchunked_recompute_longer_than_budget_still_resumes():
    """Without chunked prefill a prompt must fit the budget, but a preempted sequence's prompt plus
    output may not: it is recomputed in chunks instead of waiting forever."""
    sched = make_scheduler(4, 2, 4, chunked=False, caching=False)
    low = make_seq([1, 2, 3, 4], priority=1, arrival=0, max_tokens=4)
    sched.add(low)
    step(sched)
    high = make_seq([5, 6], priority=0, arrival=1, max_tokens=2)
    sched.add(high)
    for _ in range(50):
        if not sched.num_unfinished:
            break
        step(sched)
    assert sched.stats.num_preemptions >= 1
    assert low.is_finished and low.output_token_ids == reference_output([1, 2, 3, 4], 4)


def test_finish_frees_blocks_at_any_stage():
    sched = make_scheduler(8, 2, 4)
    running = make_seq(list(range(7)), arrival=0)
    waiting = make_seq([1, 2], arrival=1)
    sched.add(running)
    step(sched)  # mid-prefill: 4 of 7 tokens
    sched.add(waiting)
    assert running.num_computed_tokens == 4 and waiting in sched.waiting
    sched.finish(running, "abort")
    sched.finish(waiting, "abort")
    assert sched.num_unfinished == 0 and sched.block_manager.num_free_blocks == 8
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert sched.stats.finished_reasons == {"abort": 2}


def test_prefix_cache_counters_are_in_tokens():
    sched = make_scheduler(16, 4, 64)
    first = make_seq(list(range(10)), arrival=0, max_tokens=1)
    sched.add(first)
    step(sched)
    second = make_seq(list(range(8)) + [42, 43], arrival=1, max_tokens=1)
    sched.add(second)
    step(sched)
    assert sched.stats.prefix_cache_queries == 20 and sched.stats.prefix_cache_hits == 8
    assert second.request.num_cached_tokens == 8
