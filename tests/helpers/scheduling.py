"""The scheduler and block manager without a model: real Sequences, a fake KV cache that records which
prefix every slot was computed from, and a fake model that samples from the prefix it reads back."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from hypothesis import strategies as st

from tachyllm.core.block_manager import NULL_BLOCK
from tachyllm.core.scheduler import Scheduler
from tachyllm.core.sequence import Request, Sequence, SequenceStatus
from tachyllm.outputs import RequestMetrics
from tachyllm.sampling_params import SamplingParams
from tachyllm.step import SeqResult, StepBatch, StepResult


def make_seq(tokens: list[int], priority: int = 0, arrival: float = 0.0, max_tokens: int = 16) -> Sequence:
    """A real Sequence without a tokenizer behind it (the block manager and scheduler never detokenize)."""
    req = Request(
        f"r{arrival}", None, list(tokens), SamplingParams(max_tokens=max_tokens), RequestMetrics(arrival), priority
    )
    seq = Sequence(request=req, index=0, token_ids=list(tokens), num_prompt_tokens=len(tokens))
    req.seqs.append(seq)
    return seq


class FakeKV:
    """Stands in for the paged KV tensors: slot (block, offset) holds the token prefix whose last
    token's KV was written there, so reading a sequence back proves which KV it attends to. With
    a `window`, the sliding-window layers' pool, read through window_block_table."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None):
        self.block_size = block_size
        self.window = window
        self.slots: list[list[tuple[int, ...] | None]] = [[None] * block_size for _ in range(num_blocks)]

    def table(self, seq: Sequence) -> list[int]:
        return seq.block_table if self.window is None else seq.window_block_table

    def write(self, seq: Sequence, start: int, end: int) -> None:
        bs, table = self.block_size, self.table(seq)
        for p in range(start, end):
            assert self.window is None or table[p // bs] != NULL_BLOCK, f"seq {seq.seq_id} writes into NULL_BLOCK"
            self.slots[table[p // bs]][p % bs] = tuple(seq.token_ids[: p + 1])

    def check(self, seq: Sequence, end: int) -> None:
        """Positions [0, end) of seq (with a window, those a query at `end` sees) hold KV computed from
        seq's own tokens."""
        bs, table = self.block_size, self.table(seq)
        for p in range(0 if self.window is None else max(0, end - self.window + 1), end):
            got = self.slots[table[p // bs]][p % bs]
            assert got == tuple(seq.token_ids[: p + 1]), f"seq {seq.seq_id} position {p} reads KV of {got}"


# Prompts from a 3-token alphabet with shared heads, so prefixes (and repeated blocks) are common.
HEADS = [[], [0, 1, 2, 0], [0, 1, 2, 0, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1]]


prompts = st.builds(
    lambda head, tail: head + tail, st.sampled_from(HEADS), st.lists(st.integers(0, 2), max_size=8)
).filter(bool)


def next_token(prefix: tuple[int, ...]) -> int:
    """The fake model: deterministic in the whole prefix, from the same 3-token alphabet as prompts."""
    return (7 * sum(prefix) + len(prefix)) % 3


@dataclass
class Scheduled:
    """A StepBatch with the scheduler's own Sequences beside it, for assertions."""

    batch: StepBatch
    scheduled: list[SimpleNamespace]  # .seq, .num_new_tokens, .start, in batch order
    preempted: list[Sequence]

    @property
    def empty(self) -> bool:
        return not self.batch.seqs

    @property
    def num_batched_tokens(self) -> int:
        return self.batch.num_tokens


def schedule(sched: Scheduler) -> Scheduled:
    everyone = {s.seq_id: s for s in sched.waiting + sched.running}
    batch = sched.schedule()
    by_id = {s.seq_id: s for s in sched.in_flight()}
    everyone.update(by_id)
    scheduled = [SimpleNamespace(seq=by_id[s.seq_id], num_new_tokens=s.num_new_tokens, entry=s) for s in batch.seqs]
    preempted = [
        everyone[i] for i in batch.finished_seq_ids if i in everyone and everyone[i].status is SequenceStatus.WAITING
    ]
    return Scheduled(batch, scheduled, preempted)


def execute(
    sched: Scheduler, out: Scheduled, kv: FakeKV | None = None, seconds: float = 0.0, window_kv: FakeKV | None = None
) -> list[Sequence]:
    """Does what the model runner does with a batch, with the fake model (and the sliding-window layers'
    pool, read through the sequences' window tables), and hands the result (which took `seconds`) to
    the scheduler; returns the sequences that finished."""
    bm = sched.block_manager
    results = []
    for s in out.scheduled:
        seq, entry = s.seq, s.entry
        start = entry.start
        # The batch is plain data: exactly the sequence's next uncomputed tokens, in its own table.
        assert start == seq.num_computed_tokens and entry.token_ids == seq.token_ids[start : start + s.num_new_tokens]
        assert entry.block_table == seq.block_table and entry.seq_len == seq.num_tokens
        if kv is not None:
            kv.check(seq, start)  # the context this chunk attends to
            for p in range(start, start + s.num_new_tokens):
                assert bm.blocks[seq.block_table[p // bm.block_size]].ref_count == 1, "write into a shared block"
            kv.write(seq, start, start + s.num_new_tokens)
        if window_kv is not None:
            assert entry.window_block_table == seq.window_block_table
            window_kv.check(seq, start)
            window_kv.write(seq, start, start + s.num_new_tokens)
        if entry.completes:
            last = seq.num_tokens - 1
            prefix = (
                tuple(seq.token_ids)
                if kv is None
                else kv.slots[seq.block_table[last // bm.block_size]][last % bm.block_size]
            )
            results.append(SeqResult(seq.seq_id, [next_token(prefix)], [None]))
    updates = sched.update_from_output(out.batch, StepResult(results), seconds)
    return [u.seq for u in updates if u.seq.is_finished]
