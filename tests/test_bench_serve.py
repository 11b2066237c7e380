"""`tachy bench` end to end: against a fake OpenAI-compatible server with known chunk timing, against
our own server on a tiny model, and the offline throughput/latency commands."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from helpers.server import serving

from tachyllm.engine.llm_engine import LLMEngine
from tachyllm.engine_args import engine_config
from tachyllm.entrypoints.cli import build_parser, main
from tachyllm.entrypoints.serve import make_server
from tachyllm.server.app import build_app
from tachyllm.server.async_engine import AsyncEngine

FIRST_CHUNK_S, CHUNK_GAP_S, CHUNKS = 0.2, 0.1, 4
HUGE_CHUNK = 600_000  # characters of text in one server-sent event


def fake_app(seen_auth: list[str | None], served=("fake-model",), seen_models: list[str] | None = None) -> FastAPI:
    """Streams CHUNKS one-token chunks: the first after FIRST_CHUNK_S, the others CHUNK_GAP_S apart.
    A prompt containing 'refuse' gets a 400; 'midway' fails after one chunk; 'silent' streams no text.
    `served`: the models /v1/models lists; `seen_models` gets each request's model."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model"} for name in served]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        seen_auth.append(request.headers.get("authorization"))
        body = await request.json()
        if seen_models is not None:
            seen_models.append(body["model"])
        if "refuse" in body["prompt"]:
            return JSONResponse({"error": {"message": "prompt refused", "type": "invalid_request_error"}}, 400)

        async def events():
            await asyncio.sleep(FIRST_CHUNK_S)
            if "huge" in body["prompt"]:  # one event far above aiohttp's default line limit (128 KiB)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x' * HUGE_CHUNK}]})}\n\n"
                yield "data: [DONE]\n\n"
                return
            if "silent" in body["prompt"]:  # tokens that decode to no text, e.g. special tokens only
                yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': 2}})}\n\n"
                yield "data: [DONE]\n\n"
                return
            for i in range(CHUNKS):
                if i:
                    await asyncio.sleep(CHUNK_GAP_S)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}'}]})}\n\n"
                if "midway" in body["prompt"]:
                    yield 'data: {"error": {"message": "engine died", "type": "internal_error"}}\n\n'
                    break
            else:
                usage = {"prompt_tokens": 3, "completion_tokens": CHUNKS, "total_tokens": 3 + CHUNKS}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return str(tiny_model_factory("llama"))


def run_bench(tmp_path: Path, *flags: str, status: int = 0) -> dict:
    out = tmp_path / "result.json"
    assert main(["bench", "serve", "--no-progress", "--result-json", str(out), *flags]) == status
    return json.loads(out.read_text())


def write_prompts(path: Path, prompts: list[str]) -> str:
    path.write_text("".join(json.dumps({"prompt": p, "output_len": 4}) + "\n" for p in prompts))
    return str(path)


def test_fake_server_known_timing(tmp_path, model_path, capsys):
    seen_auth: list[str | None] = []
    server = uvicorn.Server(uvicorn.Config(fake_app(seen_auth), host="127.0.0.1", port=0, log_config=None))
    prompts = write_prompts(
        tmp_path / "p.jsonl", ["hello there", "refuse this", "go midway", "general kenobi", "silent one"]
    )
    with serving(server) as url:
        result = run_bench(
            tmp_path, "--base-url", f"{url}/v1", "--tokenizer", model_path, "--api-key", "sk-test",
            "--dataset", "file", "--dataset-path", prompts, "--num-prompts", "5", "--goodput", "ttft:5000",
            "--request-rate", "200,inf", "--plot", str(tmp_path / "sweep.png"), "--save-detailed",
        )  # fmt: skip
    assert seen_auth and set(seen_auth) == {"Bearer sk-test"}
    assert result["settings"]["served_model"] == "fake-model" and "api_key" not in result["settings"]
    assert [run["request_rate"] for run in result["runs"]] == [200.0, "inf"]
    m = result["runs"][1]["metrics"]
    assert (m["completed"], m["failed"]) == (2, 3)
    assert m["errors"] == {
        "HTTP 400: prompt refused": 1,
        "engine died": 1,
        "the stream carried no text, though the server reports 2 output tokens": 1,
    }
    assert m["total_output_tokens"] == 2 * CHUNKS  # from the usage chunk
    # Client-side times can only be later than the server's schedule, and not by much.
    assert FIRST_CHUNK_S <= m["ttft_ms"]["median"] / 1000 < FIRST_CHUNK_S + 0.3
    assert CHUNK_GAP_S * 0.9 <= m["itl_ms"]["median"] / 1000 < CHUNK_GAP_S + 0.1
    assert CHUNK_GAP_S * 0.9 <= m["tpot_ms"]["mean"] / 1000 < CHUNK_GAP_S + 0.1
    assert m["good_requests"] == 2
    # --save-detailed: one entry per request, in seconds, None where a request failed.
    detailed = result["runs"][1]["detailed"]
    assert sorted(detailed) == ["errors", "input_lens", "itls", "latencies", "output_lens", "ttfts"]
    assert all(len(values) == 5 for values in detailed.values())
    ok = [i for i, error in enumerate(detailed["errors"]) if error is None]
    assert len(ok) == 2 and all(detailed["ttfts"][i] is None for i in set(range(5)) - set(ok))
    for i in ok:
        assert FIRST_CHUNK_S <= detailed["ttfts"][i] < FIRST_CHUNK_S + 0.3
        assert len(detailed["itls"][i]) == CHUNKS - 1 and detailed["latencies"][i] > detailed["ttfts"][i]
        assert detailed["output_lens"][i] == CHUNKS
    assert sorted(e for e in detailed["errors"] if e) == sorted(m["errors"])
    assert result["runs"][1]["server"] is None  # no /metrics on this server
    assert (tmp_path / "sweep.png").stat().st_size > 0

    assert (
        main(
            [
                "bench",
                "plot",
                str(tmp_path / "result.json"),
                str(tmp_path / "result.json"),
                "-o",
                str(tmp_path / "two.png"),
            ]
        )
        == 0
    )
    assert (tmp_path / "two.png").stat().st_size > 0


def test_an_event_of_many_tokens_is_read_whole(tmp_path, model_path):
    """A server may send a long answer in one event (tachy serve sends what its loop has not sent yet)."""
    server = uvicorn.Server(uvicorn.Config(fake_app([]), host="127.0.0.1", port=0, log_config=None))
    prompts = write_prompts(tmp_path / "p.jsonl", ["a huge answer"])
    with serving(server) as url:
        flags = ["--dataset", "file", "--dataset-path", prompts, "--num-prompts", "1", "--save-detailed"]
        result = run_bench(tmp_path, "--base-url", url, "--tokenizer", model_path, *flags)
    m = result["runs"][0]["metrics"]
    assert (m["completed"], m["failed"]) == (1, 0), m["errors"]
    assert result["runs"][0]["detailed"]["output_lens"][0] >= HUGE_CHUNK // 16  # re-tokenized: no usage sent


def test_lora_modules_mix(tmp_path, model_path, capsys):
    """--lora-modules: each request names one of the adapters, drawn from --seed: the same mix again
    with the same seed, another with another seed; a name the server does not list stops the run."""
    seen: list[str] = []
    app = fake_app([], served=("base", "sql", "chat", "json"), seen_models=seen)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None))

    def mix(seed: str, *names: str) -> Counter:
        seen.clear()
        flags = ["--dataset", "random", "--input-len", "4", "--output-len", "4", "--num-prompts", "24"]
        run_bench(
            tmp_path, "--base-url", url, "--tokenizer", model_path, *flags, "--seed", seed, "--lora-modules", *names
        )
        return Counter(seen)

    with serving(server) as url:
        first = mix("1", "sql", "chat", "json")
        assert sum(first.values()) == 24 and set(first) == {"sql", "chat", "json"}
        assert mix("1", "sql", "chat", "json") == first
        assert mix("2", "sql", "chat", "json") != first
        assert set(mix("1", "sql")) == {"sql"}
        seen.clear()
        assert main(["bench", "serve", "--no-progress", "--base-url", url, "--tokenizer", model_path,
                     "--num-prompts", "2", "--lora-modules", "sql", "sqll"]) == 2  # fmt: skip
    assert "--lora-modules: 'sqll' not served at" in capsys.readouterr().err and not seen


RESULT_FIELDS = {
    "completed", "failed", "errors", "duration_s", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput", "peak_output_throughput",
    "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "slos_ms", "good_requests", "goodput", "cost",
}  # fmt: skip


def test_against_our_server(tmp_path, model_path, capsys):
    args = build_parser().parse_args(
        ["serve", "--model", model_path, "--port", "0", "--dtype", "float32", "--kv-cache-memory", "4M",
         "--log-stats-interval", "0", "--api-key", "secret"]
    )  # fmt: skip
    server = make_server(build_app(AsyncEngine(lambda: LLMEngine(engine_config(args))), args), args)
    common = ["--model", model_path, "--input-len", "16", "--output-len", "6", "--ignore-eos"]
    with serving(server) as url:
        result = run_bench(
            tmp_path, "--base-url", url, "--api-key", "secret", *common, "--num-prompts", "6", "--warmup", "2",
            "--max-concurrency", "3", "--goodput", "ttft:10000", "tpot:10000", "--cost-per-hour", "2",
            "--percentiles", "50,90,99",
        )  # fmt: skip
        summary = capsys.readouterr().out
        run = result["runs"][0]
        m = run["metrics"]
        assert set(m) == RESULT_FIELDS
        assert (m["completed"], m["failed"], m["total_output_tokens"]) == (6, 0, 36)
        assert m["total_input_tokens"] >= 6 * 12
        for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
            assert set(m[key]) == {"mean", "median", "p50", "p90", "p99"} and m[key]["p99"] > 0
        # ITLs are gaps between streamed chunks. The server sends, per request, everything its event
        # loop has not sent yet in one chunk, so an engine faster than the loop (a tiny model, six
        # tokens) may stream a whole answer at once and leave no gap to measure (seen in CI).
        assert m["itl_ms"] == {} or (
            set(m["itl_ms"]) == {"mean", "median", "p50", "p90", "p99"} and m["itl_ms"]["p99"] >= 0
        )
        assert m["good_requests"] == 6 and m["cost"]["usd_per_million_output_tokens"] > 0
        assert run["max_concurrency"] == 3 and run["request_rate"] == "inf"
        assert run["server"]["prefix_cache_queries"] > 0 and run["server"]["prefix_cache_hit_rate"] is not None
        spec = run["server"]["spec_decode"]  # exported, but nothing speculated
        assert spec["drafts"] == 0 and spec["acceptance_rate"] is None
        assert "Successful requests:" in summary and "P99 TTFT (ms):" in summary and "Prefix cache hit rate" in summary

        # Multi-turn chat: later turns resend the history, so they are longer; all succeed.
        chat = run_bench(
            tmp_path, "--base-url", url, "--api-key", "secret", *common, "--endpoint", "chat",
            "--dataset", "conversation", "--num-turns", "2", "--num-prompts", "4", "--request-rate", "20",
        )  # fmt: skip
        assert chat["runs"][0]["metrics"]["completed"] == 4
        assert chat["runs"][0]["metrics"]["total_input_tokens"] > 4 * 16

        # A wrong key and an over-long prompt fail, each counted with the server's message; a run where
        # every request failed exits with status 1.
        wrong = run_bench(tmp_path, "--base-url", url, "--api-key", "wrong", *common, "--num-prompts", "2", status=1)
        assert wrong["runs"][0]["metrics"]["failed"] == 2
        (message,) = wrong["runs"][0]["metrics"]["errors"]
        assert message.startswith("HTTP 401:")
        prompts = write_prompts(tmp_path / "p.jsonl", ["hello", "word " * 2000])
        mixed = run_bench(
            tmp_path, "--base-url", url, "--api-key", "secret", *common, "--dataset", "file",
            "--dataset-path", prompts, "--num-prompts", "2",
        )  # fmt: skip
        m = mixed["runs"][0]["metrics"]
        assert (m["completed"], m["failed"]) == (1, 1)
        (message,) = m["errors"]
        assert message.startswith("HTTP 400:") and "context limit" in message


def test_offline_throughput_and_latency(tmp_path, model_path, capsys):
    engine = ["--model", model_path, "--dtype", "float32", "--kv-cache-memory", "4M"]
    out = tmp_path / "tput.json"
    flags = ["--num-prompts", "4", "--input-len", "16", "--output-len", "5", "--no-progress", "--result-json", str(out)]
    assert main(["bench", "throughput", *flags, *engine]) == 0
    r = json.loads(out.read_text())["result"]
    assert (r["num_requests"], r["total_input_tokens"], r["total_output_tokens"]) == (4, 64, 20)
    assert r["output_throughput"] > 0 and r["peak_rss_mib"] > 0

    out = tmp_path / "lat.json"
    flags = [
        "--batch-size",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--num-iters",
        "2",
        "--result-json",
        str(out),
    ]
    assert main(["bench", "latency", *flags, "--bandwidth-gbs", "10", *engine]) == 0
    r = json.loads(out.read_text())["result"]
    assert r["prefill_ms"]["median"] > 0 and r["decode_step_ms"]["p99"] >= r["decode_step_ms"]["median"]
    assert r["machine_bandwidth_gbs"] == 10 and r["bandwidth_source"] == "given"
    assert r["achieved_bandwidth_gbs"] == pytest.approx(r["weight_bytes"] * r["decode_steps_per_s"] / 1e9)
    assert "decode step" in capsys.readouterr().out


# -- vLLM's `vllm bench serve` command line ------------------------------------------------------------

SHAREGPT = [
    {"conversations": [{"from": "human", "value": "The quick brown fox jumps over the lazy dog."},
                       {"from": "gpt", "value": "Paged attention stores keys and values in blocks."}]},
    {"conversations": [{"from": "human", "value": "def add(a, b): return a + b"},
                       {"from": "gpt", "value": "Schedulers batch requests continuously, numbers 42."}]},
    {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "too short a prompt to keep"}]},
    {"conversations": [{"from": "human", "value": "only one message here"}]},
    {"id": "no conversations at all"},
]  # fmt: skip


def test_sharegpt_is_read_as_vllm_reads_it(model_path, tmp_path):
    from tachyllm.bench.datasets import DatasetSpec, build_sessions
    from tachyllm.loading import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    spec = DatasetSpec("sharegpt", num_prompts=5, path=str(path))
    sessions = build_sessions(spec, tokenizer, np.random.default_rng(0))
    prompts = {s.turns[0].text: s.turns[0].output_len for s in sessions}
    assert len(sessions) == 5 and set(prompts) == {SHAREGPT[0]["conversations"][0]["value"],
                                                   SHAREGPT[1]["conversations"][0]["value"]}  # fmt: skip
    reply = SHAREGPT[0]["conversations"][1]["value"]
    assert prompts[SHAREGPT[0]["conversations"][0]["value"]] == len(tokenizer.encode(reply, add_special_tokens=False))
    fixed = build_sessions(DatasetSpec("sharegpt", 2, path=str(path), sharegpt_output_len=7), tokenizer,
                           np.random.default_rng(0))  # fmt: skip
    assert [s.turns[0].output_len for s in fixed] == [7, 7]
    for bad, message in [(None, "needs --dataset-path"), (tmp_path / "missing.json", "cannot read the ShareGPT file")]:
        with pytest.raises(ValueError, match=message):
            build_sessions(DatasetSpec("sharegpt", 2, path=bad and str(bad)), tokenizer, np.random.default_rng(0))
    (tmp_path / "short.json").write_text(json.dumps(SHAREGPT[2:]))
    with pytest.raises(ValueError, match="holds no usable ShareGPT conversation"):
        build_sessions(
            DatasetSpec("sharegpt", 2, path=str(tmp_path / "short.json")), tokenizer, np.random.default_rng(0)
        )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--backend", "tgi"], "'tgi' is not an OpenAI-compatible backend"),
        (["--endpoint", "/v1/rerank"], "unknown endpoint '/v1/rerank'"),
        (["--percentile-metrics", "ttft,latency"], "expected a comma list of ttft, tpot, itl, e2el"),
    ],
)
def test_vllm_bench_flags_refuse_what_they_cannot_mean(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_vllm_bench_serve_command_runs_unchanged(tmp_path, model_path, capsys):
    args = build_parser().parse_args(
        ["serve", "--model", model_path, "--port", "0", "--dtype", "float32", "--kv-cache-memory", "4M",
         "--log-stats-interval", "0"]
    )  # fmt: skip
    server = make_server(build_app(AsyncEngine(lambda: LLMEngine(engine_config(args))), args), args)
    with serving(server) as url:
        port = url.rsplit(":", 1)[1]
        vllm_style = [
            "bench", "serve", "--backend", "vllm", "--model", model_path, "--endpoint", "/v1/completions",
            "--port", port, "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "4",
            "--num-prompts", "3", "--ignore-eos", "--save-result", "--result-dir", str(tmp_path),
            "--result-filename", "vllm.json", "--metric-percentiles", "50,99", "--percentile-metrics", "ttft,tpot",
            "--disable-tqdm", "--trust-remote-code", "--seed", "1",
        ]  # fmt: skip
        assert main(vllm_style) == 0
        summary = capsys.readouterr().out
        result = json.loads((tmp_path / "vllm.json").read_text())
        m = result["runs"][0]["metrics"]
        assert (m["completed"], m["failed"], m["total_output_tokens"]) == (3, 0, 12)
        assert {"p50", "p99"} <= set(m["ttft_ms"]) and result["settings"]["endpoint"] == "completions"
        assert "P50 TTFT (ms):" in summary and "P99 TPOT (ms):" in summary
        assert "Inter-token Latency" not in summary and "End-to-end Latency" not in summary
        assert f"127.0.0.1:{port}/v1/completions" in summary

        sharegpt = tmp_path / "sharegpt.json"
        sharegpt.write_text(json.dumps(SHAREGPT))
        chat_style = [
            "bench", "serve", "--backend", "openai-chat", "--model", model_path, "--port", port,
            "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt), "--num-prompts", "2",
            "--sharegpt-output-len", "3", "--ignore-eos", "--save-result", "--result-dir", str(tmp_path / "out"),
            "--disable-tqdm",
        ]  # fmt: skip
        (tmp_path / "out").mkdir()
        assert main(chat_style) == 0
        (saved,) = (tmp_path / "out").glob(f"openai-chat-infqps-{Path(model_path).name}-*.json")
        chat = json.loads(saved.read_text())
        assert chat["settings"]["endpoint"] == "chat" and chat["runs"][0]["metrics"]["completed"] == 2
        assert chat["runs"][0]["metrics"]["total_output_tokens"] == 6

        mismatch = main(["bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/completions", "--port", port])
        assert mismatch == 2
        assert "--backend openai-chat sends chat requests, not to --endpoint /v1/completions" in capsys.readouterr().err
