#!/usr/bin/env bash
# The GPU check in one command, for a machine with one CUDA GPU (docs/benchmarks.md, "GPU"): the
# environment, tests/test_cuda.py, then benchmarks/gpu_bench.py in the time that is left, everything
# written under $OUT. For a machine that reaches no package index and lacks some of tachyllm's
# dependencies (llguidance, gguf, pydantic, fastapi, uvicorn): where the folder .whl holds their wheels
# (benchmarks/gpu_wheels.sh downloads them on a machine that has access), they are installed into
# $OUT/site first. env.txt records which modules are still missing.
#
#   OUT=/some/dir benchmarks/gpu_check.sh                     # from the repository root, ~9.5 minutes
#   GPU_CHECK_SECONDS=300 GPU_TEST_ARGS="-n 4" GPU_BENCH_ARGS="--models llama3-8b" benchmarks/gpu_check.sh
#
# Files under $OUT: wheels.log, env.txt (GPU, versions, importable modules), test_cuda.log and test_cuda.xml,
# gpu_bench.log, gpu_bench.md (the benchmark's one result file: tables, then JSON), summary.txt.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-$PWD/gpu_check_out}
PYTHON=${PYTHON:-python3}
BUDGET=${GPU_CHECK_SECONDS:-560}  # the whole script; a device command may run 600 s
TEST_SECONDS=${GPU_TEST_SECONDS:-240}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$OUT/site" \
        .whl/*.whl >"$OUT/wheels.log" 2>&1 && PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export OUT PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
elapsed() { echo $(($(date +%s) - start)); }

{
    nvidia-smi || true
    "$PYTHON" - <<'EOF'
import importlib
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
for name in ("triton", "transformers", "tokenizers", "safetensors", "pytest", "xdist", "httpx", "fastapi",
             "uvicorn", "pydantic", "llguidance", "gguf", "tachyllm", "vllm"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as e:  # missing, or broken on import: both matter
        print(f"{name} MISSING ({type(e).__name__}: {e})")
EOF
} >"$OUT/env.txt" 2>&1
echo "[$(elapsed) s] environment: $OUT/env.txt" | tee "$OUT/summary.txt"

# shellcheck disable=SC2086  # GPU_TEST_ARGS is a list of flags
timeout "$TEST_SECONDS" "$PYTHON" -m pytest -q -p no:cacheprovider -rs --durations=15 ${GPU_TEST_ARGS:-} \
    tests/test_cuda.py --junitxml="$OUT/test_cuda.xml" >"$OUT/test_cuda.log" 2>&1
rc=$?
echo "[$(elapsed) s] pytest tests/test_cuda.py: exit $rc ($(tail -n 1 "$OUT/test_cuda.log"))" | tee -a "$OUT/summary.txt"

# The benchmark gets what is left, less a margin for its own cut-off phase and the report.
left=$((BUDGET - $(elapsed) - 20))
if [ "$left" -lt 60 ]; then
    echo "[$(elapsed) s] gpu_bench.py: skipped, ${left} s left" | tee -a "$OUT/summary.txt"
    exit 0
fi
# shellcheck disable=SC2086  # GPU_BENCH_ARGS is a list of flags
timeout $((left + 15)) "$PYTHON" benchmarks/gpu_bench.py --time-budget "$left" ${GPU_BENCH_ARGS:-} \
    >"$OUT/gpu_bench.log" 2>&1
rc=$?
echo "[$(elapsed) s] gpu_bench.py (budget ${left} s): exit $rc, result $OUT/gpu_bench.md" | tee -a "$OUT/summary.txt"
