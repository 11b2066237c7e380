"""The pooling API over HTTP: /v1/embeddings (the openai client, float and base64; LangChain's
OpenAIEmbeddings), /v1/score and /v1/rerank in vLLM's, Jina's and Cohere's shapes, against the offline
LLM.embed / LLM.score of the same model; /v1/models saying what each model is for; every bad input a 4xx
naming its field, the server serving on; pooling requests in /metrics."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from helpers.pooling_models import make_tiny_bert
from helpers.server import error_of, metrics, running_server, wait_idle

from tachyllm import LLM, faults
from tachyllm.bench.serve import load_tokenizer
from tachyllm.entrypoints.cli import main

TEXTS = ["The quick brown fox", "Paged attention stores keys", "def add(a, b): return a + b"]
QUERY = "What stores keys and values?"
# Small bounds, so that the bad inputs stay cheap: 8 inputs a request, 100 tokens in all (the tiny
# BERT's own limit is 64 tokens an input).
BOUNDS = ["--max-pooling-inputs", "8", "--max-request-tokens", "100"]


@pytest.fixture(scope="module")
def embedder_path(tmp_path_factory) -> str:
    """A sentence-transformers folder: the pooling runner by itself."""
    return str(make_tiny_bert(tmp_path_factory.mktemp("embedder"), normalize=False))


@pytest.fixture(scope="module")
def cross_encoder_path(tmp_path_factory) -> str:
    return str(make_tiny_bert(tmp_path_factory.mktemp("cross-encoder"), classifier=True))


@pytest.fixture(scope="module")
def url(embedder_path) -> Iterator[str]:
    with running_server(embedder_path, "--served-model-name", "embedder", *BOUNDS) as base:
        yield base


@pytest.fixture(scope="module")
def embedder(embedder_path) -> LLM:
    return LLM(embedder_path, dtype="float32")


@pytest.fixture(scope="module")
def cross_url(cross_encoder_path) -> Iterator[str]:
    with running_server(cross_encoder_path, "--served-model-name", "reranker") as base:
        yield base


@pytest.fixture(scope="module")
def cross_http(cross_url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=cross_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def generator_url(tiny_model_factory) -> Iterator[str]:
    with running_server(str(tiny_model_factory("llama"))) as base:
        yield base


def offline_embeddings(llm: LLM, texts: list[str]) -> list[list[float]]:
    return [out.outputs.embedding for out in llm.embed(texts)]


def test_openai_client_embeddings_as_floats_and_base64(client, embedder):
    expected = offline_embeddings(embedder, TEXTS)
    response = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    assert [d.index for d in response.data] == [0, 1, 2] and response.model == "embedder"
    for got, want in zip(response.data, expected):
        assert got.embedding == pytest.approx(want, abs=1e-5)
    prompt_tokens = sum(len(out.prompt_token_ids) for out in embedder.embed(TEXTS))
    assert response.usage.prompt_tokens == response.usage.total_tokens == prompt_tokens
    # Unasked, the client sends base64 and decodes it itself; asked, it hands the string over.
    assert client.embeddings.create(model="embedder", input=TEXTS[0]).data[0].embedding == pytest.approx(
        expected[0], abs=1e-5
    )
    raw = client.embeddings.create(model="embedder", input=TEXTS[:2], encoding_format="base64").data
    for got, want in zip(raw, expected):
        packed = base64.b64decode(got.embedding)
        assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(want, abs=1e-5)


def test_token_id_inputs(http, embedder):
    ids = [out.prompt_token_ids for out in embedder.embed(TEXTS[:2])]
    expected = offline_embeddings(embedder, TEXTS[:2])
    one = http.post("/v1/embeddings", json={"input": ids[0]}).json()
    assert one["data"][0]["embedding"] == pytest.approx(expected[0], abs=1e-5)
    several = http.post("/v1/embeddings", json={"input": ids}).json()
    assert [d["embedding"] for d in several["data"]] == [pytest.approx(e, abs=1e-5) for e in expected]
    assert several["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_normalize_and_truncation(http, embedder):
    plain = http.post("/v1/embeddings", json={"input": TEXTS[0], "normalize": False}).json()["data"][0]["embedding"]
    unit = http.post("/v1/embeddings", json={"input": TEXTS[0], "normalize": True}).json()["data"][0]["embedding"]
    assert torch.tensor(unit).norm().item() == pytest.approx(1.0, abs=1e-5)
    assert torch.nn.functional.normalize(torch.tensor(plain), dim=0).tolist() == pytest.approx(unit, abs=1e-5)
    cut = http.post("/v1/embeddings", json={"input": TEXTS[0], "truncate_prompt_tokens": 2}).json()
    assert cut["usage"]["prompt_tokens"] == 2


def test_dimensions_on_a_matryoshka_model(tmp_path):
    """The first `dimensions` values, normalized again (vLLM's, OpenAI's); at most the model's width."""
    path = make_tiny_bert(tmp_path / "matryoshka", is_matryoshka=True)
    with running_server(str(path)) as base, httpx.Client(base_url=base, timeout=60) as http:
        full = http.post("/v1/embeddings", json={"input": TEXTS[0]}).json()["data"][0]["embedding"]
        cut = http.post("/v1/embeddings", json={"input": TEXTS[0], "dimensions": 16}).json()["data"][0]["embedding"]
        assert len(full) == 64 and len(cut) == 16
        assert cut == pytest.approx(torch.nn.functional.normalize(torch.tensor(full[:16]), dim=0).tolist(), abs=1e-5)
        assert http.get("/v1/models").json()["data"][0]["task"] == "embed"
        error = error_of(http.post("/v1/embeddings", json={"input": "a", "dimensions": 65}), 400)
        assert error["param"] == "dimensions" and "[1, 64]" in error["message"]


def test_langchain_openai_embeddings(url, embedder_path, embedder, monkeypatch):
    """LangChain tokenizes with tiktoken by default (whose tables it downloads: offline, a ConnectionError
    before any request) and sends the token ids of OpenAI's tokenizer, which this model's vocabulary does
    not know: a 400 naming input. Sending the text (check_embedding_ctx_length=False, as vLLM's docs
    advise), or tokenizing with the model's own tokenizer (tiktoken_enabled=False, which sends the
    chunks as text), works offline."""
    import tiktoken
    from langchain_openai import OpenAIEmbeddings

    expected = offline_embeddings(embedder, TEXTS)
    common = {"model": "embedder", "base_url": f"{url}/v1", "api_key": "unused", "max_retries": 0}
    as_text = OpenAIEmbeddings(**common, check_embedding_ctx_length=False)
    own_tokenizer = OpenAIEmbeddings(**common, tiktoken_enabled=False, tiktoken_model_name=embedder_path)
    for embeddings in (as_text, own_tokenizer):
        assert embeddings.embed_documents(TEXTS) == [pytest.approx(e, abs=1e-5) for e in expected]
        assert embeddings.embed_query(TEXTS[1]) == pytest.approx(expected[1], abs=1e-5)
    # The default, with a local stand-in for OpenAI's tables: one id per byte, from 1000 up.
    foreign = tiktoken.Encoding(
        "bytes", pat_str=r"\S+|\s+", mergeable_ranks={bytes([b]): 1000 + b for b in range(256)}, special_tokens={}
    )
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: foreign)
    with pytest.raises(openai.BadRequestError) as refused:
        OpenAIEmbeddings(**common).embed_documents(TEXTS)
    assert refused.value.body["param"] == "input" and "token ids must be in [0, " in refused.value.body["message"]


def test_score_shapes_match_offline_scores(http, embedder):
    def scores(body: dict) -> list[float]:
        response = http.post("/v1/score", json=body).json()
        assert [d["index"] for d in response["data"]] == list(range(len(response["data"])))
        return [d["score"] for d in response["data"]]

    one_to_one = scores({"text_1": QUERY, "text_2": TEXTS[0]})
    assert one_to_one == pytest.approx([embedder.score(QUERY, TEXTS[0])[0].outputs.score], abs=1e-5)
    one_to_n = scores({"text_1": QUERY, "text_2": TEXTS})
    assert one_to_n == pytest.approx([o.outputs.score for o in embedder.score(QUERY, TEXTS)], abs=1e-5)
    assert scores({"text_1": [QUERY], "text_2": TEXTS}) == pytest.approx(one_to_n, abs=1e-6)
    pairwise = scores({"text_1": TEXTS, "text_2": TEXTS[::-1]})
    assert pairwise == pytest.approx([o.outputs.score for o in embedder.score(TEXTS, TEXTS[::-1])], abs=1e-5)
    assert pairwise[1] == pytest.approx(1.0, abs=1e-5)  # a text against itself
    error = error_of(http.post("/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS}), 400)
    assert error["param"] == "text_2" and "give one text_1" in error["message"]


def test_rerank_shapes(http, embedder):
    expected = [o.outputs.score for o in embedder.score(QUERY, TEXTS)]
    order = sorted(range(len(TEXTS)), key=lambda i: -expected[i])
    documents = [TEXTS[0], {"text": TEXTS[1]}, TEXTS[2]]  # strings, or Jina's objects
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        body = http.post(path, json={"model": "embedder", "query": QUERY, "documents": documents}).json()
        assert [r["index"] for r in body["results"]] == order
        for r in body["results"]:
            assert r["relevance_score"] == pytest.approx(expected[r["index"]], abs=1e-5)
            assert r["document"] == {"text": TEXTS[r["index"]]}
        assert body["usage"]["total_tokens"] > 0 and body["model"] == "embedder"
    top = http.post("/v1/rerank", json={"query": QUERY, "documents": TEXTS, "top_n": 2, "return_documents": False})
    assert [r["index"] for r in top.json()["results"]] == order[:2]
    assert all(r["document"] is None for r in top.json()["results"])
    everything = http.post("/v1/rerank", json={"query": QUERY, "documents": TEXTS, "top_n": 10}).json()
    assert len(everything["results"]) == 3


def test_cross_encoder_scores_pairs(cross_http, cross_encoder_path):
    llm = LLM(cross_encoder_path, dtype="float32")
    expected = [o.outputs.score for o in llm.score(QUERY, TEXTS)]
    assert all(0 < s < 1 for s in expected)
    body = cross_http.post("/v1/score", json={"text_1": QUERY, "text_2": TEXTS}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    ranked = cross_http.post("/v1/rerank", json={"query": QUERY, "documents": TEXTS}).json()["results"]
    assert [r["index"] for r in ranked] == sorted(range(3), key=lambda i: -expected[i])
    assert [r["relevance_score"] for r in ranked] == pytest.approx(sorted(expected, reverse=True), abs=1e-5)
    card = cross_http.get("/v1/models").json()["data"][0]
    assert card["task"] == "score" and card["endpoints"] == ["/v1/score", "/v1/rerank"]
    error = error_of(cross_http.post("/v1/embeddings", json={"input": "x"}), 400)
    assert error["param"] == "model" and "cross-encoder" in error["message"]


def test_models_say_what_each_is_for(http, generator_url):
    card = http.get("/v1/models").json()["data"][0]
    assert card["task"] == "embed" and "/v1/embeddings" in card["endpoints"]
    with httpx.Client(base_url=generator_url, timeout=60) as generator:
        card = generator.get("/v1/models").json()["data"][0]
        assert card["task"] == "generate" and "/v1/chat/completions" in card["endpoints"]
        for path, body in (
            ("/v1/embeddings", {"input": "hello"}),
            ("/v1/score", {"text_1": "a", "text_2": "b"}),
            ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ):
            error = error_of(generator.post(path, json=body), 400)
            assert (
                error["param"] == "model" and "text generation model" in error["message"] and path in error["message"]
            )
    for path, body in (
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"input": "hi"}),
    ):
        error = error_of(http.post(path, json=body), 400)
        assert error["param"] == "model" and "embedding model" in error["message"] and path in error["message"]


LONG = "The quick brown fox jumps over the lazy dog. " * 40

# (route, body, the field the 400 names, a word of its message)
BAD_INPUTS = [
    ("/v1/embeddings", {"input": ""}, "input", "at least 1"),
    ("/v1/embeddings", {"input": []}, "input", "must be"),
    ("/v1/embeddings", {"input": [[]]}, "input", "at least 1 item"),
    ("/v1/embeddings", {"input": ["a", 1]}, "input", "must be"),
    ("/v1/embeddings", {"input": [1.5]}, "input", "must be"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input", "at least 1 character"),
    ("/v1/embeddings", {"input": None}, "input", "must be"),
    ("/v1/embeddings", {}, "input", "Field required"),
    ("/v1/embeddings", {"input": ["a"] * 10_000}, "input", "--max-pooling-inputs"),
    ("/v1/embeddings", {"input": ["a"] * 9}, "input", "--max-pooling-inputs"),
    ("/v1/embeddings", {"input": [LONG, "b"]}, "input", "limit"),
    ("/v1/embeddings", {"input": ["a " * 30] * 5}, "input", "--max-request-tokens"),
    ("/v1/embeddings", {"input": [0, 1, 10**6]}, "input", "token ids must be in [0, "),
    ("/v1/embeddings", {"input": [[1, 2], [-1]]}, "input", "greater than or equal to 0"),
    ("/v1/embeddings", {"input": "a", "dimensions": 0}, "dimensions", "greater than or equal to 1"),
    ("/v1/embeddings", {"input": "a", "dimensions": -3}, "dimensions", "greater than or equal to 1"),
    ("/v1/embeddings", {"input": "a", "dimensions": 8}, "dimensions", "Matryoshka"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format", "float"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "-1"),
    ("/v1/embeddings", {"input": "a", "temperature": 1}, "temperature", "unknown field"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents", "at least 1"),
    ("/v1/rerank", {"query": "q"}, "documents", "Field required"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query", "at least 1"),
    ("/v1/rerank", {"query": "q", "documents": ["a", 3]}, "documents[1]", "must be"),
    ("/v1/rerank", {"query": "q", "documents": [{"txt": "a"}]}, "documents[0].txt", "unknown field"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n", "greater than or equal to 0"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 1.5}, "top_n", "integer"),
    ("/v1/rerank", {"query": "q", "documents": ["a"] * 9}, "documents", "--max-pooling-inputs"),
    ("/v1/rerank", {"query": "q", "documents": ["a", LONG]}, "documents", "limit"),
    ("/v1/score", {"text_1": "q", "text_2": []}, "text_2", "at least 1 item"),
    ("/v1/score", {"text_1": "q", "text_2": ["a", None]}, "text_2", "must be"),
    ("/v1/score", {"text_1": "q", "text_2": ["a"] * 9}, "text_2", "--max-pooling-inputs"),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), BAD_INPUTS)
def test_bad_input_is_a_400_naming_the_field(http, path, body, param, message):
    error = error_of(http.post(path, json={"model": "embedder", **body}), 400)
    assert error["param"] == param and message in error["message"], error


def test_the_server_serves_on_after_bad_inputs(http):
    before = metrics(http)
    for _, body, _, _ in BAD_INPUTS[:12]:
        http.post("/v1/embeddings", json=body)
    good = http.post("/v1/embeddings", json={"input": TEXTS})
    assert good.status_code == 200 and len(good.json()["data"]) == 3
    after = wait_idle(http)
    assert after[("tachy:num_requests_running", ())] == after[("tachy:num_requests_waiting", ())] == 0
    # The refused requests never reached the engine: only the good one's three inputs did.
    e2e = ("tachy:e2e_request_latency_seconds_count", ())
    assert after[e2e] - before.get(e2e, 0) == 3


def test_an_encoders_input_is_bounded_by_its_positions_not_a_kv_cache(http, embedder):
    """An encoder keeps no KV cache (its engine holds one placeholder block): a text longer than that block
    could spell is refused only beyond the model's own input limit, before tokenizing too."""
    tokenizer = embedder.engine.tokenizer
    placeholder = embedder.engine.input_processor.limits.context_limit
    word = max((t for t in tokenizer.get_vocab() if t.isalpha()), key=len)
    count = placeholder * tokenizer.max_token_chars // (len(word) + 1) + 1
    text = " ".join([word] * count)
    assert len(text) > placeholder * tokenizer.max_token_chars and count + 2 <= 64  # the tiny BERT's positions
    response = http.post("/v1/embeddings", json={"input": text}).json()
    assert response["usage"]["prompt_tokens"] == count + 2  # [CLS] ... [SEP]
    assert response["data"][0]["embedding"] == pytest.approx(offline_embeddings(embedder, [text])[0], abs=1e-5)


def test_small_requests_are_tokenized_and_encoded_on_the_event_loop(http, embedder, monkeypatch):
    """A few short texts cost less to tokenize and their answer less to encode than a hop to a worker
    thread and back; bigger requests (here: the bounds lowered under this one) go to a worker thread."""
    import asyncio

    from tachyllm.engine.input_processor import InputProcessor
    from tachyllm.server import pooling
    from tachyllm.server.routes import embeddings

    def on_event_loop() -> bool:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return False
        return True

    seen: list[tuple[str, bool]] = []
    process, encode = InputProcessor.process_pooling, embeddings.encode_embedding

    def recording_process(self, *args, **kwargs):
        seen.append(("tokenize", on_event_loop()))
        return process(self, *args, **kwargs)

    def recording_encode(*args):
        seen.append(("encode", on_event_loop()))
        return encode(*args)

    monkeypatch.setattr(InputProcessor, "process_pooling", recording_process)
    monkeypatch.setattr(embeddings, "encode_embedding", recording_encode)
    expected = offline_embeddings(embedder, TEXTS)
    for inline in (True, False):
        if not inline:
            monkeypatch.setattr(pooling, "INLINE_MAX_CHARS", 10)
            monkeypatch.setattr(embeddings, "INLINE_MAX_FLOATS", 10)
        seen.clear()
        response = http.post("/v1/embeddings", json={"input": TEXTS}).json()
        assert [d["embedding"] for d in response["data"]] == [pytest.approx(e, abs=1e-5) for e in expected]
        assert seen == [("tokenize", inline)] * 3 + [("encode", inline)] * 3


def test_an_engine_failure_is_a_500_and_the_server_serves_on(http):
    def fail_the_second_input(stage: str, request_ids: list[str]) -> None:
        if stage == "forward" and any(rid.endswith("-1") for rid in request_ids):
            raise RuntimeError("injected")

    with faults.injected(fail_the_second_input):
        response = http.post("/v1/embeddings", json={"input": TEXTS})
    error = error_of(response, 500)
    assert error["code"] == "engine_error" and "injected" in error["message"]
    assert http.post("/v1/embeddings", json={"input": TEXTS}).status_code == 200
    idle = wait_idle(http)
    assert idle[("tachy:num_requests_running", ())] == idle[("tachy:num_requests_waiting", ())] == 0


def test_pooling_requests_in_metrics(http):
    before = metrics(http)
    body = http.post("/v1/embeddings", json={"input": TEXTS}).json()
    prompt_tokens = body["usage"]["prompt_tokens"]
    after = wait_idle(http)

    def grew(name: str, *labels: tuple[str, str]) -> float:
        return after[(name, tuple(labels))] - before.get((name, tuple(labels)), 0)

    assert grew("tachy:prompt_tokens_total") == prompt_tokens
    assert grew("tachy:request_success_total", ("finished_reason", "stop")) == 3
    for histogram in ("e2e_request_latency", "request_queue_time", "request_prefill_time", "request_inference_time"):
        assert grew(f"tachy:{histogram}_seconds_count") == 3, histogram
    assert grew("tachy:request_prompt_tokens_count") == 3
    assert grew("tachy:request_prompt_tokens_sum") == prompt_tokens


def test_bench_serve_measures_embeddings(url, embedder_path, tmp_path, capsys):
    result_file = tmp_path / "embeddings.json"
    command = [
        "bench", "serve", "--base-url", url, "--endpoint", "/v1/embeddings", "--model", "embedder",
        "--tokenizer", embedder_path, "--dataset-name", "random", "--random-input-len", "8", "--num-prompts", "6",
        "--max-concurrency", "2", "--metric-percentiles", "50,99", "--result-json", str(result_file),
        "--disable-tqdm",
    ]  # fmt: skip
    assert main(command) == 0
    summary = capsys.readouterr().out
    run = json.loads(result_file.read_text())["runs"][0]["metrics"]
    assert (run["completed"], run["failed"], run["total_output_tokens"]) == (6, 0, 0)
    assert {"p50", "p99"} <= set(run["e2el_ms"]) and run["request_throughput"] > 0
    assert "Input throughput (inputs/s):" in summary and "P99 E2EL (ms):" in summary
    assert "TTFT" not in summary and f"{url}/v1/embeddings" in summary


def test_bench_serve_counts_tokens_with_the_served_models_tokenizer(embedder_path, tmp_path, capsys):
    """Neither --model nor --tokenizer: the model is the first the server lists, here a local folder, whose
    tokenizer counts the inputs (not the embedded default model's, which splits these texts otherwise)."""
    dataset = tmp_path / "texts.jsonl"
    texts = [*TEXTS, QUERY]
    dataset.write_text("".join(json.dumps({"prompt": t, "output_len": 1}) + "\n" for t in texts))
    result_file = tmp_path / "counted.json"
    with running_server(embedder_path) as base:
        command = [
            "bench", "serve", "--base-url", base, "--endpoint", "embeddings", "--dataset", "file",
            "--dataset-path", str(dataset), "--num-prompts", "4", "--no-progress", "--result-json", str(result_file),
        ]  # fmt: skip
        assert main(command) == 0
    counted = json.loads(result_file.read_text())["runs"][0]["metrics"]["total_input_tokens"]
    assert counted == sum(len(load_tokenizer(embedder_path, None).encode(t)) for t in texts)
    assert counted != sum(len(load_tokenizer(None, None).encode(t)) for t in texts)
