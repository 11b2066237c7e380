"""Throughput-latency curves from `tachy bench serve` result files: one line per file (a server, a
configuration), one point per sweep point, so several servers compare on one chart."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def load_result(path: str) -> dict[str, Any]:
    result = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(result, dict) or "runs" not in result:
        raise ValueError(f"{path} is not a `tachy bench serve --result-json` file")
    result.setdefault("settings", {}).setdefault("label", Path(path).stem)
    return result


def point_label(run: dict[str, Any]) -> str:
    """What varied along the sweep: the rate, and the concurrency when one was set."""
    rate = run["request_rate"]
    label = f"{rate}/s" if rate == "inf" else f"{rate:g}/s"
    return label if run["max_concurrency"] is None else f"{label} c{run['max_concurrency']}"


def plot_results(results: list[dict[str, Any]], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    for result in results:
        label = result["settings"]["label"]
        runs = [r for r in result["runs"] if r["metrics"]["completed"]]
        throughput = [r["metrics"]["output_throughput"] for r in runs]
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            latency = [r["metrics"][key].get("p99", math.nan) for r in runs]
            (line,) = ax.plot(latency, throughput, marker="o", label=label)
            for x, y, run in zip(latency, throughput, runs):
                ax.annotate(
                    point_label(run),
                    (x, y),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                    color=line.get_color(),
                )
    for ax, name in zip(axes, ("TTFT", "TPOT")):
        ax.set_xscale("log")  # servers compared on one chart can differ by orders of magnitude
        ax.set_xlabel(f"{name} p99 (ms)")
        ax.set_ylabel("output throughput (tok/s)")
        ax.set_title(f"Throughput vs {name} p99")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(output, dpi=120)
    plt.close(fig)


def cmd_bench_plot(args: Any) -> int:
    plot_results([load_result(path) for path in args.results], args.output)
    print(f"plot written to {args.output}")
    return 0
