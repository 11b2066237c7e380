"""The step-time model and the decode-latency-aware prefill cap (max_decode_slowdown)."""

from __future__ import annotations

import pytest
from helpers.scheduling import execute, make_seq, schedule

from tachyllm.config import EngineConfig, SchedulerConfig
from tachyllm.core.block_manager import BlockManager
from tachyllm.core.scheduler import Scheduler, step_shape
from tachyllm.core.sequence import Sequence
from tachyllm.core.step_cost import MIN_STEPS, StepCostModel, StepShape, attention_pairs
from tachyllm.errors import ConfigError
from tachyllm.outputs import StepStats
from tachyllm.step import StepBatch

FIXED, PER_TOKEN, PER_PAIR, PER_READ = 0.010, 0.002, 1e-6, 2e-6


def true_cost(shape: StepShape) -> float:
    return FIXED + PER_TOKEN * shape.tokens + PER_PAIR * shape.pairs + PER_READ * shape.context


def test_attention_pairs_counts_causal_query_key_pairs():
    assert attention_pairs(0, 1) == 1
    assert attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert attention_pairs(10, 2) == 11 + 12


def test_step_shape_of_a_sequence_and_sums():
    assert StepShape.of(10, 2) == StepShape(2, 11 + 12, 12)
    assert StepShape.of(0, 3) + StepShape.of(5, 1) == StepShape(4, 6 + 6, 9)


def test_model_recovers_coefficients_and_waits_for_variety():
    model = StepCostModel()
    decode = StepShape(8, 800, 800)
    for _ in range(MIN_STEPS * 2):
        model.observe(decode, true_cost(decode))  # one shape only: cannot separate the terms
    assert model.predict(decode) is None
    shapes = [(24, 70_000, 3_000), (8, 1_000, 1_000), (40, 200_000, 6_000), (16, 30_000, 900), (9, 900, 900),
              (70, 500_000, 9_000), (12, 48_000, 4_100)]  # fmt: skip
    for shape in map(lambda s: StepShape(*s), shapes):
        model.observe(shape, true_cost(shape))
    fixed, per_token, per_pair, per_read = model.coefficients()
    assert fixed == pytest.approx(FIXED, rel=1e-3)
    assert per_token == pytest.approx(PER_TOKEN, rel=1e-3)
    assert per_pair == pytest.approx(PER_PAIR, rel=1e-3)
    assert per_read == pytest.approx(PER_READ, rel=1e-3)


def test_model_never_predicts_negative_costs():
    model = StepCostModel()
    # Noise that a plain fit would explain with a negative per-pair cost.
    for i in range(20):
        shape = StepShape(8 + i, 1000 * (20 - i) ** 2, 100 * i)
        model.observe(shape, 0.01 + 0.001 * shape.tokens - (1e-9 * shape.pairs if i % 2 else 0))
    assert all(c >= 0 for c in model.coefficients())


def run_with_cost(sched: Scheduler, steps: int, watched: Sequence) -> list[tuple[int, float, float]]:
    """Steps the scheduler, charging each step the true cost; for each step that carries a chunk of
    `watched` next to decodes: (chunk tokens, cost of the step, cost of its decodes alone)."""
    chunks = []
    for _ in range(steps):
        out = schedule(sched)
        if out.empty:
            break
        cost = true_cost(step_shape(out.batch))
        chunk = next((s.num_new_tokens for s in out.scheduled if s.seq is watched), 0)
        if chunk and len(out.scheduled) > 1:
            decodes = [s for s in out.batch.seqs if s.seq_id != watched.seq_id]
            assert all(s.num_new_tokens == 1 for s in decodes), "the decodes always get their token"
            chunks.append((chunk, cost, true_cost(step_shape(StepBatch(decodes)))))
        execute(sched, out, seconds=cost)
    return chunks


def test_prefill_chunks_shrink_to_keep_decodes_within_the_slowdown():
    limits = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=512, enable_chunked_prefill=True, max_decode_slowdown=2.0
    )
    sched = Scheduler(BlockManager(4096, 16, True), limits, StepStats())
    streams = [make_seq([1, 2, 3, i], arrival=i, max_tokens=600) for i in range(4)]
    long_prompt = make_seq([1] * 3000, arrival=10, max_tokens=1)
    for seq in streams:
        sched.add(seq)
    run_with_cost(sched, 20, long_prompt)
    sched.add(long_prompt)
    chunks = run_with_cost(sched, 3000, long_prompt)
    assert long_prompt.is_finished
    for chunk, cost, alone in chunks:
        assert chunk == 1 or cost <= 2.0 * alone * (1 + 1e-9)
    # The chunks shrink as the context they attend to grows, and are as large as the limit allows.
    sizes = [chunk for chunk, _, _ in chunks]
    assert sizes[0] > sizes[-1] >= 1
    assert max(cost / alone for _, cost, alone in chunks) > 1.8


def test_without_decodes_a_prompt_takes_the_whole_budget():
    limits = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=256, enable_chunked_prefill=True, max_decode_slowdown=1.5
    )
    sched = Scheduler(BlockManager(4096, 16, True), limits, StepStats())
    for shape in [StepShape(8, 100, 100), StepShape(200, 20_000, 200), StepShape(30, 5_000, 900)] * 4:
        sched.step_cost.observe(shape, true_cost(shape))
    seq = make_seq([1] * 1000, max_tokens=1)
    sched.add(seq)
    assert [s.num_new_tokens for s in sched.schedule().seqs] == [256]


def test_slowdown_must_exceed_one():
    with pytest.raises(ConfigError, match="max_decode_slowdown"):
        EngineConfig(max_decode_slowdown=1.0)


def test_engine_output_is_unchanged_by_the_cap(tiny_model_factory):
    from tachyllm import LLM, SamplingParams

    path = str(tiny_model_factory("llama"))
    prompts = ["hi", "def add(a, b): return a + b " * 8, "x y", "The quick brown fox " * 6]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = []
    for slowdown in (None, 1.2):
        llm = LLM(model=path, dtype="float32", max_num_batched_tokens=64, max_decode_slowdown=slowdown)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        if slowdown is not None:
            assert llm.engine.scheduler.step_cost.coefficients() is not None, "the model was never fitted"
    assert outputs[0] == outputs[1]
