#!/usr/bin/env bash
# Fills .whl (ignored by git) with the wheels a GPU machine without a package index may lack, for a
# Python 3.12 there; benchmarks/gpu_check.sh installs them on that machine. Run it from the repository
# root where PyPI is reachable, then copy .whl along with the checkout. Versions: tachyllm's pins
# (pyproject.toml) and their own dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo "/.whl/" >>.git/info/exclude; }
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .whl llguidance==1.9.1 gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 \
    opentelemetry-api==1.45.2
ls .whl
