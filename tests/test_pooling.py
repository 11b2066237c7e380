"""Pooling models (docs/pooling.md): BERT embedders and cross-encoders, causal models as embedders, against
transformers and a plain reference written here; packing invariance, truncation, bad inputs, faults."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tachyllm import faults
from tachyllm.config import EngineConfig
from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.entrypoints.llm import LLM
from tachyllm.errors import ConfigError, ModelLoadError, RequestError
from tachyllm.outputs import PoolingRequestOutput
from tachyllm.pooling_params import PoolingParams
from tachyllm.sampling_params import SamplingParams
from tests.helpers.models import make_tiny_model
from tests.helpers.pooling_models import make_tiny_bert

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "numbers 42",
    "Paged attention stores keys and values in fixed-size blocks, and schedulers batch requests.",
    "def add(a, b): return a + b",
]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("bert"), pooling="mean", normalize=True, is_matryoshka=True)


@pytest.fixture(scope="module")
def bert(bert_dir) -> LLM:
    return LLM(str(bert_dir), dtype="float32")


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("cross"), classifier=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"))


def hf_tokens(directory: Path, text: str, pair: str | None = None) -> dict[str, torch.Tensor]:
    import transformers

    return transformers.AutoTokenizer.from_pretrained(directory)(text, pair, return_tensors="pt")


def reference_bert(directory: Path, input_ids: torch.Tensor, token_types: torch.Tensor) -> torch.Tensor:
    """BERT's encoder written out from the checkpoint's tensors: every token's final hidden state."""
    w = load_file(str(directory / "model.safetensors"))
    w = {k.removeprefix("bert."): v for k, v in w.items()}
    cfg = json.loads((directory / "config.json").read_text())
    heads, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]

    def norm(x, name):
        return F.layer_norm(x, x.shape[-1:], w[f"{name}.weight"], w[f"{name}.bias"], eps)

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    n = len(input_ids)
    x = w["embeddings.word_embeddings.weight"][input_ids] + w["embeddings.position_embeddings.weight"][:n]
    x = norm(x + w["embeddings.token_type_embeddings.weight"][token_types], "embeddings.LayerNorm")
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        q, k, v = (
            linear(x, f"{p}.attention.self.{m}").view(n, heads, -1).transpose(0, 1) for m in ("query", "key", "value")
        )
        scores = torch.softmax(q @ k.transpose(1, 2) / q.shape[-1] ** 0.5, dim=-1)
        attended = (scores @ v).transpose(0, 1).reshape(n, -1)
        x = norm(linear(attended, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
        hidden = F.gelu(linear(x, f"{p}.intermediate.dense"))
        x = norm(linear(hidden, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
    return x


def embedding(out) -> torch.Tensor:
    assert out.error is None, out.error
    return torch.tensor(out.outputs.embedding)


def test_bert_embeddings_equal_transformers_and_a_plain_reference(bert_dir, bert):
    import transformers

    model = transformers.BertModel.from_pretrained(bert_dir).eval()
    outs = bert.embed(TEXTS)  # inputs of different lengths packed in one step
    for text, out in zip(TEXTS, outs):
        enc = hf_tokens(bert_dir, text)
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state[0]
        mine = reference_bert(bert_dir, enc["input_ids"][0], enc["token_type_ids"][0])
        torch.testing.assert_close(mine, hidden, atol=1e-5, rtol=0)
        assert out.prompt_token_ids == enc["input_ids"][0].tolist()
        torch.testing.assert_close(embedding(out), F.normalize(hidden.mean(0), dim=0), atol=1e-5, rtol=0)
        torch.testing.assert_close(embedding(out), F.normalize(mine.mean(0), dim=0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("pooling", ["cls", "last"])
def test_bert_pooling_modes_and_no_normalize_module(tmp_path, pooling):
    import transformers

    directory = make_tiny_bert(tmp_path, pooling=pooling, normalize=False, seed=1)
    llm = LLM(str(directory), dtype="float32")
    model = transformers.BertModel.from_pretrained(directory).eval()
    for text, out in zip(TEXTS[:2], llm.embed(TEXTS[:2])):
        with torch.no_grad():
            hidden = model(**hf_tokens(directory, text)).last_hidden_state[0]
        expected = hidden[0] if pooling == "cls" else hidden[-1]
        torch.testing.assert_close(embedding(out), expected, atol=1e-5, rtol=0)


def test_an_embedding_is_the_same_alone_and_packed_with_other_lengths(bert):
    alone = [embedding(bert.embed(text)[0]) for text in TEXTS]
    packed = [embedding(out) for out in bert.embed(TEXTS + TEXTS[::-1])]
    for i, vector in enumerate(alone):
        assert torch.equal(packed[i], vector)
        assert torch.equal(packed[len(TEXTS) * 2 - 1 - i], vector)


def test_encoder_linears_see_steps_padded_to_a_multiple_of_8_rows_and_warm_up_runs_them(bert_dir):
    llm = LLM(str(bert_dir), dtype="bfloat16")
    rows: list[int] = []
    hook = llm.engine.runner.model.layers[0].up_proj.register_forward_hook(
        lambda _m, args, _o: rows.append(args[0].shape[0])
    )
    try:
        alone = [embedding(llm.embed(text)[0]) for text in TEXTS]
        packed = [embedding(out) for out in llm.embed(TEXTS)]
        lengths = [len(llm.get_tokenizer().encode_pair(text)[0]) for text in TEXTS]
        expected = [-(-n // 8) * 8 for n in lengths] + [-(-sum(lengths) // 8) * 8]
        assert rows == expected
        assert all(torch.equal(a, p) for a, p in zip(alone, packed, strict=True))
        rows.clear()
        llm.engine.runner.warm_up(32)
        assert rows == [8, 16, 24, 32]
    finally:
        hook.remove()


def test_matryoshka_dimensions_cut_then_renormalise(bert_dir, bert):
    import transformers

    model = transformers.BertModel.from_pretrained(bert_dir).eval()
    with torch.no_grad():
        hidden = model(**hf_tokens(bert_dir, TEXTS[0])).last_hidden_state[0]
    out = bert.embed(TEXTS[0], pooling_params=PoolingParams(dimensions=16))[0]
    assert len(out.outputs.embedding) == 16
    torch.testing.assert_close(embedding(out), F.normalize(hidden.mean(0)[:16], dim=0), atol=1e-5, rtol=0)


def test_cross_encoder_scores_equal_transformers(cross_encoder_dir):
    import transformers

    llm = LLM(str(cross_encoder_dir), dtype="float32")
    assert llm.engine.runner_type == "pooling" and llm.engine.pooling_tasks == {"classify", "score"}
    model = transformers.BertForSequenceClassification.from_pretrained(cross_encoder_dir).eval()
    query, documents = TEXTS[0], TEXTS[1:]
    scores = llm.score(query, documents)
    for document, out in zip(documents, scores):
        assert out.error is None
        with torch.no_grad():
            logit = model(**hf_tokens(cross_encoder_dir, query, document)).logits[0, 0]
        assert abs(out.outputs.score - torch.sigmoid(logit).item()) < 1e-5
    pairwise = llm.score(documents, documents[::-1])  # N-to-N
    assert len(pairwise) == len(documents)
    assert abs(pairwise[1].outputs.score - llm.score(documents[1], documents[1])[0].outputs.score) < 1e-6
    probs = llm.classify(TEXTS[0])[0].outputs.probs
    with torch.no_grad():
        logit = model(**hf_tokens(cross_encoder_dir, TEXTS[0])).logits[0, 0]
    assert abs(probs[0] - torch.sigmoid(logit).item()) < 1e-5
    with pytest.raises(RequestError, match="does not serve 'embed'"):
        llm.embed(TEXTS[0])


def test_a_bi_encoder_scores_by_cosine_similarity(bert):
    a, b = bert.embed([TEXTS[0], TEXTS[2]])
    score = bert.score(TEXTS[0], [TEXTS[2]])[0].outputs.score
    assert abs(score - F.cosine_similarity(embedding(a), embedding(b), dim=0).item()) < 1e-6
    with pytest.raises(RequestError, match="1-to-N or N-to-N"):
        bert.score(TEXTS[:2], TEXTS[:3])


def test_a_qwen3_embedder_pools_its_last_token(tmp_path):
    import transformers

    directory = make_tiny_model(tmp_path, arch="qwen3")
    llm = causal_embedder(directory)
    assert llm.engine.pooling_setup.pooling_type == "LAST"
    model = transformers.AutoModel.from_pretrained(directory).eval()
    prompt = list(range(5, 25))
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    out = llm.embed({"prompt_token_ids": prompt})[0]
    torch.testing.assert_close(embedding(out), F.normalize(hidden[-1], dim=0), atol=1e-5, rtol=0)
    text = llm.embed(TEXTS[0])[0]  # a text is tokenized as transformers' tokenizer does it
    assert text.prompt_token_ids == transformers.AutoTokenizer.from_pretrained(directory)(TEXTS[0]).input_ids
    assert llm.score(TEXTS[0], TEXTS[1])[0].error is None  # by cosine similarity: no text pair


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_a_causal_model_embeds_as_transformers_llama_pools(llama_dir, pooling_type):
    """Prefilled in chunks of 8 tokens (with prefix caching on): the running sum / the last row carry
    across chunks, and the KV blocks are all free at the end."""
    import transformers

    llm = LLM(
        str(llama_dir), dtype="float32", runner="pooling", convert="embed", pooling_type=pooling_type,
        max_num_batched_tokens=8, block_size=4, kv_cache_memory=4 << 20, max_model_len=256,
    )  # fmt: skip
    assert llm.engine.pooling_tasks == {"embed"} and llm.engine.embedding_dim == 64
    model = transformers.AutoModel.from_pretrained(llama_dir).eval()
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 30)]
    for _ in range(2):  # the second round meets its prompts' blocks in the prefix cache
        for prompt, out in zip(prompts, llm.embed([{"prompt_token_ids": p} for p in prompts])):
            with torch.no_grad():
                hidden = model(torch.tensor([prompt])).last_hidden_state[0]
            pooled = hidden[-1] if pooling_type == "LAST" else hidden.mean(0)
            torch.testing.assert_close(embedding(out), F.normalize(pooled, dim=0), atol=1e-5, rtol=0)
    manager = llm.engine.block_manager
    manager.check_invariants([])
    assert manager.num_free_blocks == manager.num_blocks


def test_truncate_prompt_tokens_keeps_an_encoders_first_tokens_and_its_last(tmp_path):
    directory = make_tiny_bert(tmp_path, max_seq_length=8)
    llm = LLM(str(directory), dtype="float32")
    assert llm.engine.max_model_len == 8
    long_text = TEXTS[2]
    refused = llm.embed(long_text)[0]
    assert refused.error is not None and "truncate_prompt_tokens" in refused.error
    full_ids = llm.get_tokenizer().encode_pair(long_text)[0]
    kept = full_ids[:5] + full_ids[-1:]
    cut = llm.embed(long_text, truncate_prompt_tokens=6)[0]
    assert cut.prompt_token_ids == kept
    assert torch.equal(embedding(cut), embedding(llm.embed({"prompt_token_ids": kept})[0]))
    at_limit = llm.embed(long_text, truncate_prompt_tokens=-1)[0]
    assert at_limit.prompt_token_ids == full_ids[:7] + full_ids[-1:]


def bad_request(engine: LLMEngine, prompt, params) -> RequestError:
    with pytest.raises(RequestError) as info:
        engine.add_request("bad", prompt, params)
    assert not engine.has_unfinished_requests()
    return info.value


def test_bad_pooling_inputs_are_refused_naming_the_field(bert):
    engine = bert.engine
    vocab = engine.model_config.vocab_size
    cases = [
        ("", PoolingParams(), "input"),
        ([], PoolingParams(), "input"),
        ([1, vocab], PoolingParams(), "input"),
        ([1, -1], PoolingParams(), "input"),
        ([1, "2"], PoolingParams(), "input"),
        ([1] * 65, PoolingParams(), "input"),  # over the model's 64 positions
        ("text", PoolingParams(dimensions=0), "dimensions"),
        ("text", PoolingParams(dimensions=65), "dimensions"),
        ("text", PoolingParams(dimensions=True), "dimensions"),
        ("text", PoolingParams(task="score"), "task"),
        ("text", PoolingParams(task="nonsense"), "task"),  # type: ignore[arg-type]
        ("text", PoolingParams(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
        ("text", PoolingParams(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
        ("text", PoolingParams(normalize="yes"), "normalize"),  # type: ignore[arg-type]
        ("text", SamplingParams(max_tokens=4), "model"),  # a generation request to a pooling engine
    ]
    for prompt, params, field in cases:
        assert bad_request(engine, prompt, params).param == field, (prompt, params)
    assert embedding(bert.embed(TEXTS[1])[0]).shape == (64,)  # the engine serves on


def test_dimensions_need_a_matryoshka_model(tmp_path):
    llm = LLM(str(make_tiny_bert(tmp_path)), dtype="float32")
    assert not llm.engine.is_matryoshka
    out = llm.embed("text", pooling_params=PoolingParams(dimensions=8))[0]
    assert out.error is not None and "Matryoshka" in out.error


def test_a_pooling_request_to_a_generation_engine_is_refused(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=4 << 20, max_model_len=256)
    assert llm.engine.runner_type == "generate" and llm.engine.pooling_tasks == frozenset()
    assert bad_request(llm.engine, "some text", PoolingParams()).param == "model"
    with pytest.raises(RequestError, match="does not serve 'embed'"):
        llm.embed("some text")
    embedder = LLM(str(llama_dir), dtype="float32", task="embed", kv_cache_memory=4 << 20, max_model_len=256)
    vocab = embedder.engine.model_config.vocab_size
    cases = [
        ([1, 2, 3], SamplingParams(max_tokens=2), "model"),
        ("", PoolingParams(), "input"),
        ([1, vocab], PoolingParams(), "input"),
        ([1] * 257, PoolingParams(), "input"),
        ("text", PoolingParams(dimensions=8), "dimensions"),  # not a Matryoshka model
    ]
    for prompt, params, field in cases:
        assert bad_request(embedder.engine, prompt, params).param == field, (prompt, params)
    cut = embedder.embed({"prompt_token_ids": [1] * 257}, truncate_prompt_tokens=-1)[0]
    assert cut.error is None and len(cut.prompt_token_ids) == 256
    manager = embedder.engine.block_manager
    manager.check_invariants([])
    assert manager.num_free_blocks == manager.num_blocks


def test_runner_options_that_cannot_run_are_config_errors(bert_dir, llama_dir):
    with pytest.raises(ConfigError, match="cannot generate"):
        LLMEngine(EngineConfig(model=str(bert_dir), runner="generate"))
    with pytest.raises(ConfigError, match="classification head"):
        LLMEngine(EngineConfig(model=str(llama_dir), convert="classify"))
    with pytest.raises(ConfigError, match="needs the pooling runner"):
        EngineConfig(task="embed", runner="generate")
    assert EngineConfig(task="embed").runner == "pooling"
    assert EngineConfig(convert="embed").runner == "pooling"


def test_unsupported_sentence_transformers_pooling_is_a_load_error(tmp_path):
    directory = make_tiny_bert(tmp_path)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError, match="pooling_mode_max_tokens"):
        LLM(str(directory), dtype="float32")


@pytest.mark.parametrize("stage", ["prepare", "forward", "sample", "output"])
def test_a_failed_pooling_step_fails_its_requests_and_the_engine_serves_on(bert, stage):
    engine = bert.engine

    def hook(where: str, request_ids: list[str]) -> None:
        if where == stage and "doomed" in request_ids:
            raise RuntimeError(f"injected {stage} fault")

    with faults.injected(hook):
        engine.add_request("doomed", TEXTS[0], PoolingParams())
        outputs: list = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
    assert len(outputs) == 1 and isinstance(outputs[0], PoolingRequestOutput)
    assert outputs[0].error is not None and "injected" in outputs[0].error and outputs[0].finished
    assert embedding(bert.embed(TEXTS[0])[0]).shape == (64,)


def test_default_bf16_embeddings_are_close_and_still_packing_invariant(bert_dir, bert):
    llm = LLM(str(bert_dir))  # bfloat16, the default backend's kernels
    assert llm.engine.dtype == torch.bfloat16
    packed = [embedding(out) for out in llm.embed(TEXTS)]
    for text, vector, exact in zip(TEXTS, packed, bert.embed(TEXTS)):
        assert F.cosine_similarity(vector, embedding(exact), dim=0) > 0.999
        assert torch.equal(embedding(llm.embed(text)[0]), vector)


def test_inputs_pack_into_steps_under_the_token_budget(bert_dir, bert):
    lengths = [len(bert.get_tokenizer().encode_pair(text)[0]) for text in TEXTS]
    budget = max(lengths) - 1  # the longest input cannot run: an encoder's input is never split
    llm = LLM(str(bert_dir), dtype="float32", max_num_batched_tokens=budget)
    outs = llm.embed(TEXTS)
    longest = lengths.index(max(lengths))
    assert outs[longest].error is not None and f"limit ({budget})" in outs[longest].error
    assert all(out.error is None for i, out in enumerate(outs) if i != longest)
    # Inputs join a step in arrival order while they fit its budget.
    steps, room = 0, 0
    for n in (n for i, n in enumerate(lengths) if i != longest):
        if n > room:
            steps, room = steps + 1, budget
        room -= n
    assert llm.engine.stats.num_steps == steps
    assert llm.engine.stats.iteration_tokens == sum(lengths) - max(lengths)
    one_step = LLM(str(bert_dir), dtype="float32")
    one_step.embed(TEXTS)
    assert one_step.engine.stats.num_steps == 1


def test_the_async_engine_streams_one_final_pooling_output(bert_dir):
    import asyncio

    from tachyllm.server.async_engine import AsyncEngine

    engine = AsyncEngine(lambda: LLMEngine(EngineConfig(model=str(bert_dir), dtype="float32")))
    try:
        assert (engine.runner_type, engine.pooling_tasks, engine.embedding_dim) == ("pooling", {"embed"}, 64)

        async def embed() -> list:
            processed = [engine.input_processor.process_pooling(text, PoolingParams()) for text in TEXTS[:2]]
            streams = await engine.add_requests([(f"r{i}", req, req.params) for i, req in enumerate(processed)])
            return [[out async for out in stream] for stream in streams]

        results = asyncio.run(embed())
        assert [len(outs) for outs in results] == [1, 1]
        assert all(isinstance(outs[0], PoolingRequestOutput) and outs[0].finished for outs in results)
        assert results[0][0].outputs.data.shape == (64,)
    finally:
        engine.shutdown()


def test_a_pooling_request_wakes_its_event_loop_once(bert_dir):
    """Its acceptance comes with its output, in one call from the engine thread: not a wake-up before the
    step and another after it. A refused request is still answered with its error."""
    import asyncio

    from tachyllm.server.async_engine import AsyncEngine

    engine = AsyncEngine(lambda: LLMEngine(EngineConfig(model=str(bert_dir), dtype="float32")))

    async def embed(requests: list) -> tuple[list, int]:
        loop = asyncio.get_running_loop()
        wakes = []
        schedule = loop.call_soon_threadsafe

        def counted(*args):
            wakes.append(args)
            return schedule(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        streams = await engine.add_requests(requests)
        return [[out async for out in stream] for stream in streams], len(wakes)

    try:
        for count in (1, 3):
            processed = [engine.input_processor.process_pooling(text, PoolingParams()) for text in TEXTS[:count]]
            results, wakes = asyncio.run(embed([(f"r{count}-{i}", r, r.params) for i, r in enumerate(processed)]))
            assert [len(outs) for outs in results] == [1] * count and all(outs[0].finished for outs in results)
            assert wakes == 1
        with pytest.raises(RequestError, match="vocabulary|token"):
            asyncio.run(embed([("bad", [10**6], PoolingParams())]))
    finally:
        engine.shutdown()


def causal_embedder(llama_dir: Path, **options) -> LLM:
    defaults = dict(dtype="float32", convert="embed", block_size=4, kv_cache_memory=4 << 20, max_model_len=256)
    return LLM(str(llama_dir), **{**defaults, **options})


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS", "LAST"])
def test_pooling_across_chunks_starts_over_when_a_sequence_is_recomputed(pooling_type):
    """A preempted sequence is recomputed from its first token: what its lost chunks added is dropped."""
    from tachyllm.runner.model_runner import PoolingRows
    from tachyllm.step import PoolingInput, ScheduledSeq, StepBatch

    hidden = torch.randn(12, 8)
    pooling = PoolingInput(pooling_type, "embed", normalize=False)

    def chunk(start: int, n: int, finished: list[int] | None = None) -> StepBatch:
        seq = ScheduledSeq(
            seq_id=7, request_id="r", start=start, token_ids=[1] * n, num_draft_tokens=0, block_table=[],
            seq_len=12, completes=start + n == 12, pooling=pooling,
        )  # fmt: skip
        return StepBatch([seq], finished or [])

    rows = PoolingRows()
    assert rows.pool(hidden[:5], chunk(0, 5), model=None) == {}  # type: ignore[arg-type]
    # Preempted (the batch says it ended), then recomputed from the start in two other chunks.
    assert rows.pool(torch.randn(4, 8), chunk(0, 4, finished=[7]), model=None) == {}  # type: ignore[arg-type]
    assert rows.pool(hidden[:4], chunk(0, 4), model=None) == {}  # type: ignore[arg-type]
    result = rows.pool(hidden[4:], chunk(4, 8), model=None)[7]  # type: ignore[arg-type]
    expected = {"MEAN": hidden.mean(0), "CLS": hidden[0], "LAST": hidden[-1]}[pooling_type]
    torch.testing.assert_close(result, expected)
    assert rows.states == {}


def test_a_fault_in_a_causal_embedders_chunk_returns_its_blocks(llama_dir):
    llm = causal_embedder(llama_dir, max_num_batched_tokens=8)
    engine, steps = llm.engine, []

    def hook(where: str, request_ids: list[str]) -> None:
        if where == "forward" and "doomed" in request_ids:
            steps.append(1)
            if len(steps) == 2:  # its second chunk: the first one's blocks are held
                raise RuntimeError("injected forward fault")

    with faults.injected(hook):
        engine.add_request("doomed", list(range(5, 35)), PoolingParams())
        engine.add_request("fine", list(range(40, 45)), PoolingParams())
        outputs: dict = {}
        while engine.has_unfinished_requests():
            outputs.update((out.request_id, out) for out in engine.step())
    assert "injected" in outputs["doomed"].error
    assert outputs["fine"].error is None or "injected" in outputs["fine"].error  # in the failed step, or after
    manager = engine.block_manager
    manager.check_invariants([])
    assert manager.num_free_blocks == manager.num_blocks
    assert embedding(llm.embed({"prompt_token_ids": list(range(5, 35))})[0]).shape == (64,)


def test_an_encoder_never_advises_on_prefix_caching(bert_dir, caplog):
    """An encoder keeps no KV cache: inputs sharing a head shorter than a block are no missed cache hits."""
    llm = LLM(str(bert_dir), dtype="float32", block_size=16)
    with caplog.at_level(logging.WARNING, logger="tachyllm"):
        llm.embed([{"prompt_token_ids": [101, 7, 8, 9, 10, 11, 12, 13, 20 + i, 102]} for i in range(8)])
    assert llm.engine.block_manager.enable_prefix_caching is False
    assert not [r for r in caplog.records if "prefix caching" in r.getMessage()]
