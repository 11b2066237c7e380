"""What loading a LoRA adapter costs: its load time (rank 16 on all seven projections of the default
model, as a PEFT folder and as llama.cpp's GGUF file), and the worst inter-token gap of running streams
while an adapter is hot-loaded on the server (POST /v1/load_lora_adapter, then its first request),
against the worst gap of the same streams with no load, in the same run.

The adapters are random (tests/helpers/lora_files.py writes them in PEFT's and llama.cpp's formats).
The server runs in this process (a uvicorn thread); rounds alternate "no load" and "load", and each
load is of a new adapter name, so its files are read anew.

    .venv/bin/python benchmarks/lora_load_bench.py                      # the default model, 4 streams
    .venv/bin/python benchmarks/lora_load_bench.py --rounds 4 --streams 8 --tokens 128 --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers.lora_files import ALL_TARGETS, write_adapter, write_gguf_adapter  # noqa: E402
from helpers.server import thread_server  # noqa: E402

from tachyllm.lora.adapter_files import load_adapter  # noqa: E402
from tachyllm.model_config import ModelConfig  # noqa: E402


def write_adapters(cfg: ModelConfig, root: Path, rank: int) -> dict[str, Path]:
    """A rank-`rank` adapter on all seven projections, as a PEFT folder and as a GGUF file. The helpers
    read the base's shapes from an HF config.json; one with the served model's shapes is written."""
    shapes = root / "base"
    shapes.mkdir()
    (shapes / "config.json").write_text(json.dumps({
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size, "head_dim": cfg.head_dim,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": cfg.num_layers,
    }))  # fmt: skip
    peft = write_adapter(root / "peft", shapes, ALL_TARGETS, rank=rank, alpha=2 * rank, seed=1)
    return {"peft": peft, "gguf": write_gguf_adapter(root / "adapter.gguf", shapes, peft)}


def load_times(cfg: ModelConfig, paths: dict[str, Path], rank: int, reps: int) -> dict[str, list[float]]:
    """Seconds to read and check each format's files (alternating), as the server's worker thread does."""
    times: dict[str, list[float]] = {kind: [] for kind in paths}
    for _ in range(reps):
        for kind, path in paths.items():
            start = time.perf_counter()
            load_adapter(str(path), cfg, rank)
            times[kind].append(time.perf_counter() - start)
    return times


async def stream_gaps(client: httpx.AsyncClient, prompt: str, tokens: int, started: asyncio.Event) -> list[float]:
    """The gaps between consecutive streamed chunks of one completion (the first token's wait left out)."""
    body = {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    arrivals = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) >= 4:  # decoding, with most of its tokens to come
                        started.set()
    finally:
        started.set()
    return [b - a for a, b in zip(arrivals, arrivals[1:])]


async def one_round(url: str, streams: int, tokens: int, load: tuple[str, Path] | None) -> tuple[float, float]:
    """(worst gap, load-to-first-answer seconds or 0) of `streams` streams, with a hot-load once every
    stream is decoding."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = [asyncio.Event() for _ in range(streams)]
        tasks = [asyncio.ensure_future(stream_gaps(client, f"Story {i}: once upon", tokens, started[i]))
                 for i in range(streams)]  # fmt: skip
        load_s = 0.0
        await asyncio.gather(*(e.wait() for e in started))
        if load is not None:
            name, path = load
            start = time.perf_counter()
            loaded = await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
            loaded.raise_for_status()
            body = {"model": name, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
            (await client.post("/v1/completions", json=body)).raise_for_status()
            load_s = time.perf_counter() - start
        gaps = [g for gs in await asyncio.gather(*tasks) for g in gs]
    return max(gaps), load_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each kind (no load, load), alternating")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--load-reps", type=int, default=5, help="timed reads of each adapter format")
    opts = parser.parse_args()
    flags = [] if opts.model is None else ["--model", opts.model]
    flags += ["--enable-lora", "--max-lora-rank", str(opts.rank), "--allow-runtime-lora-updating"]
    flags += ["--max-num-seqs", str(opts.streams + 1)]
    flags += [] if opts.threads is None else ["--threads", str(opts.threads)]
    quiet = ["--log-stats-interval", "0", "--disable-log-requests", "--uvicorn-log-level", "warning"]
    with thread_server([*quiet, *flags]) as (url, _, engine):
        with tempfile.TemporaryDirectory() as tmp:
            paths = write_adapters(engine.model_config, Path(tmp), opts.rank)
            reads = load_times(engine.model_config, paths, opts.rank, opts.load_reps)
            for kind, values in reads.items():
                files = [paths[kind]] if paths[kind].is_file() else list(paths[kind].iterdir())
                size = sum(f.stat().st_size for f in files)
                print(f"read + check, {kind:4}: median {1000 * statistics.median(values):6.1f} ms "
                      f"(range {1000 * min(values):.1f}-{1000 * max(values):.1f}), {size / 1e6:.1f} MB")  # fmt: skip
            asyncio.run(one_round(url, 2, 16, None))  # warm-up
            worst: dict[str, list[float]] = {"no load": [], "load": []}
            loads: list[float] = []
            for r in range(opts.rounds):
                for kind in ("no load", "load") if r % 2 == 0 else ("load", "no load"):
                    fmt = "gguf" if r % 2 else "peft"
                    load = (f"hot-{r}", paths[fmt]) if kind == "load" else None
                    gap, load_s = asyncio.run(one_round(url, opts.streams, opts.tokens, load))
                    worst[kind].append(gap)
                    if load is not None:
                        loads.append(load_s)
                    what = f", hot-load ({fmt}) to its first answer {1000 * load_s:.0f} ms" if load else ""
                    print(f"round {r} {kind:7}: worst inter-token gap {1000 * gap:6.1f} ms{what} "
                          f"(load {os.getloadavg()[0]:.1f})")  # fmt: skip
    calm, loaded = statistics.median(worst["no load"]), statistics.median(worst["load"])
    print(f"worst gap, median over rounds: no load {1000 * calm:.1f} ms, load {1000 * loaded:.1f} ms "
          f"({loaded / calm:.2f}x); ranges {[round(1000 * g, 1) for g in worst['no load']]} vs "
          f"{[round(1000 * g, 1) for g in worst['load']]}")  # fmt: skip


if __name__ == "__main__":
    main()
