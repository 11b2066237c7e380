#!/usr/bin/env bash
# llama.cpp's server for the comparison: a `llama-server` binary on PATH is used as it is; without
# one, llama-cpp-python[server] is built into its own virtual environment ($CACHE/llamacpp-venv).
# The build compiles llama.cpp from source (cmake and a C++ compiler needed; several minutes).
# shellcheck source=benchmarks/competitors/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if command -v llama-server >/dev/null; then
    echo "using $(command -v llama-server)"
    exit 0
fi
python3 -m venv "$LLAMACPP_VENV"
# Built for this CPU's instruction set, as a local llama.cpp build would be.
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
    "$LLAMACPP_VENV/bin/pip" install --disable-pip-version-check "llama-cpp-python[server]==0.3.36"
"$LLAMACPP_VENV/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__, "ready in '"$LLAMACPP_VENV"'")'
