"""Engines on tiny models: an `LLM` stepped to completion with the block manager's invariants checked
after every step, engines on a given backend or GGUF file, hand-built scheduled sequences, prompts."""

from __future__ import annotations

import random
from pathlib import Path

from tachyllm import LLM, SamplingParams
from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.outputs import RequestOutput
from tachyllm.sampling_params import SamplingParams as Params
from tachyllm.step import SamplingInput, ScheduledSeq

GREEDY = {"temperature": 0, "ignore_eos": True}


def tiny_llm(path, **options) -> LLM:
    defaults = {"dtype": "float32", "block_size": 4, "kv_cache_memory": 4 << 20, "max_model_len": 256}
    return LLM(str(path), **{**defaults, **options})


def random_prompts(seed: int, count: int, shared: int, tail: tuple[int, int]) -> list[list[int]]:
    """`count` prompts of token ids: a common head of `shared` tokens, then a distinct tail."""
    rng = random.Random(seed)
    head = [rng.randrange(5, 300) for _ in range(shared)]
    return [head + [rng.randrange(5, 300) for _ in range(rng.randint(*tail))] for _ in range(count)]


def run(
    llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams], prefix: str = ""
) -> list[RequestOutput]:
    """Adds all prompts, steps the engine to completion checking invariants after every step, and
    returns the outputs in prompt order."""
    eng = llm.engine
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for request_id, prompt, p in zip(ids, prompts, params_list):
        eng.add_request(request_id, prompt, p)
    done: dict[str, RequestOutput] = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        check_blocks(llm)
    assert_all_free(llm)
    return [done[i] for i in ids]


def check_blocks(llm: LLM) -> None:
    sched = llm.engine.scheduler
    llm.engine.block_manager.check_invariants(sched.running + sched.waiting)


def assert_all_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    """Each output's first sample's tokens; every request must have succeeded."""
    assert all(o.error is None for o in outputs), [o.error for o in outputs]
    return [o.outputs[0].token_ids for o in outputs]


def backend_engine(path, backend: str, **kwargs) -> LLMEngine:
    options = {"dtype": "float32", "block_size": 4, "kv_cache_memory": 4 << 20, "threads": 1} | kwargs
    return LLMEngine(EngineConfig(model=str(path), backend=backend, **options))


def scheduled_seq(
    seq_id: int, prompt: list[int], start: int, num_real: int, drafts: list[int], table: list[int]
) -> ScheduledSeq:
    """Positions [start, start + num_real) of prompt, then the drafts; sampled when the prompt is done."""
    completes = start + num_real == len(prompt)
    sampling = SamplingInput(Params(), prompt, len(prompt)) if completes else None
    tokens = prompt[start : start + num_real] + drafts
    return ScheduledSeq(
        seq_id=seq_id,
        request_id=str(seq_id),
        start=start,
        token_ids=tokens,
        num_draft_tokens=len(drafts),
        block_table=table,
        seq_len=len(prompt),
        completes=completes,
        sampling=sampling,
    )


def gguf_engine(path: Path, **kwargs) -> LLMEngine:
    config = dict(model=str(path), max_num_seqs=2, max_model_len=128, threads=1, dtype="float32")
    return LLMEngine(EngineConfig(**{**config, **kwargs}))
