// Declarations shared by the kernel sources and the Python bindings (bindings.cpp). Every op
// opens a RECORD_FUNCTION range named "native::<op>" so that `tachy bench latency --profile` sees it.
#pragma once
#include <torch/extension.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <functional>

// One iteration of a wait on another thread's flag: tells the core the loop spins.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Kernels run without the GIL (as ATen ops do), so that the server's event loop thread can stream
// tokens while the engine thread computes.
using ReleaseGil = pybind11::call_guard<pybind11::gil_scoped_release>;

// elementwise.cpp
void rms_norm(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& weight, double eps);
void add_rms_norm(torch::Tensor x, torch::Tensor residual, const torch::Tensor& weight, double eps);
void rotary_inplace(torch::Tensor q, torch::Tensor k, const torch::Tensor& positions, const torch::Tensor& cos,
                    const torch::Tensor& sin);
torch::Tensor silu_mul(const torch::Tensor& gate_up);

// attention.cpp
void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor k_cache, torch::Tensor v_cache,
              const torch::Tensor& slots, const c10::optional<torch::Tensor>& k_scale = c10::nullopt,
              const c10::optional<torch::Tensor>& v_scale = c10::nullopt);
// A quantized cache (int8, float8_e4m3fn, float8_e5m2) holds value / scale, with one fp32 scale per
// KV head in k_scale / v_scale (required for those caches, unused otherwise). window > 0: sliding-window
// attention, a query sees only the `window` positions up to its own (blocks before every query's
// window are not read).
void paged_attention(torch::Tensor out, const torch::Tensor& q, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_info,
                     double scale, const c10::optional<torch::Tensor>& k_scale = c10::nullopt,
                     const c10::optional<torch::Tensor>& v_scale = c10::nullopt, int64_t window = 0);

// encoder_attention.cpp: each input of a packed encoder step (rows [seq_starts[b], seq_starts[b + 1]))
// attending to itself bidirectionally; out's rows after the last input are zeroed.
void encoder_attention(torch::Tensor out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& seq_starts, double scale);

// quant_gemv.cpp: layout int64 [parts, 2] of (GGML block type, out_features), the matrices stacked in `packed`.
torch::Tensor quant_gemv(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& layout,
                         int64_t activation_bits);
// Work a caller runs inside a quantized linear's parallel region (quant_gemv_then): thread t of n runs
// `shared(t, n)`, its share of work that needs only the input, before its tiles; after them, once every
// thread's shared work is done, `columns(out, begin, end)` on the output columns [begin, end) it
// computed, whose linear outputs are final (out: the output's first row, rows `out_features` apart). LoRA adapters on
// decode steps (decode_layer.cpp) run this way instead of after the linear, on one thread or in a region of their own.
struct LinearEpilogue {
  std::function<void(int64_t t, int64_t n)> shared;
  std::function<void(void* out, int64_t begin, int64_t end)> columns;
};
torch::Tensor quant_gemv_then(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& layout,
                              int64_t activation_bits, const LinearEpilogue& epilogue);
void register_quant_gemv(pybind11::module_& m);

// bf16_gemv.cpp
torch::Tensor bf16_linear(const torch::Tensor& input, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& bias);
void register_bf16_gemv(pybind11::module_& m);

// decode_layer.cpp
void register_decode_layer(pybind11::module_& m);

// lora.cpp (the classes: lora.h)
void register_lora(pybind11::module_& m);

// shm_allreduce.cpp
void register_shm_allreduce(pybind11::module_& m);

// thread_affinity.cpp: team thread t (t >= 1) of the caller's OpenMP team pinned to cpus[t] (< 0: left as
// it is); returns each team thread's CPU, -1 where none was set.
std::vector<int64_t> bind_team_threads(const std::vector<int64_t>& cpus);

// suffix_tree.cpp: suffix decoding's trees (a class, SuffixTree)
void register_suffix_tree(pybind11::module_& m);
