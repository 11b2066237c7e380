# shellcheck shell=bash
# shellcheck disable=SC2034  # the settings below are read by the scripts that source this file
# Settings and helpers shared by the competitor scripts; sourced, not run.
# Knobs, read from the environment with a TACHY_BENCH_ prefix because the servers read settings
# from the environment too (llama-cpp-python would take CACHE or PORT as its own):
#   TACHY_BENCH_THREADS  compute threads of every server (default: all cores)
#   TACHY_BENCH_CACHE    the competitors' virtual environments and the converted model (~/.cache/tachyllm-bench)
#   TACHY_BENCH_RESULTS  output folder (benchmarks/competitors/results)
#   TACHY_BENCH_GGUF     the model (default: the embedded SmolLM2-135M-Instruct GGUF)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PY="$ROOT/.venv/bin/python"
TACHY="$ROOT/.venv/bin/tachy"
CACHE="${TACHY_BENCH_CACHE:-$HOME/.cache/tachyllm-bench}"
RESULTS="${TACHY_BENCH_RESULTS:-$HERE/results}"
THREADS="${TACHY_BENCH_THREADS:-$(nproc)}"

# Every server answers to the same name, so one `tachy bench serve` command fits all of them.
MODEL_NAME=smollm2-135m
GGUF="${TACHY_BENCH_GGUF:-$("$PY" -c 'from tachyllm.loading.default_model import default_model_path; print(default_model_path())')}"
HF_DIR="$CACHE/smollm2-135m-hf"  # the same GGUF converted for vLLM (setup_vllm.sh)
LLAMACPP_VENV="$CACHE/llamacpp-venv"
VLLM_VENV="$CACHE/vllm-venv"

# wait_ready URL PID LOG: until URL/v1/models answers; fails if the server process dies or takes over 10 minutes.
wait_ready() {
    local url=$1 pid=$2 log=$3 deadline=$((SECONDS + 600))
    until curl -sf "$url/v1/models" >/dev/null; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "server exited before it was ready; its log ($log):" >&2
            tail -20 "$log" >&2
            return 1
        fi
        if ((SECONDS > deadline)); then
            echo "server not ready after 10 minutes; see $log" >&2
            return 1
        fi
        sleep 2
    done
}

# stop_server PID: SIGTERM, then SIGKILL if it is still there after 30 s.
stop_server() {
    local pid=$1
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 30); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 1
    done
    kill -9 "$pid" 2>/dev/null || true
}
