// One decoder layer of a step whose attention runs in paged_attention, in a single call.
//
// After the kernels of this folder, what was left of a small decode step was Python: ~20 calls per
// layer (modules, views, checks), ~2.5 ms of a 6.4 ms step at batch 1. A DecodeLayer holds one
// layer's weights as the kernels want them and chains the same kernels the Python modules call,
// in the same order, so its results are those of the module path. With LoRA adapters (set_lora), each
// linear's output gets the step's adapter rows added as the wrapped linears add them (lora.cpp).
#include <array>
#include <memory>

#include "lora.h"
#include "ops.h"

namespace {

enum class LinearKind : int64_t { Bf16 = 0, Blocks = 1 };

struct Linear {
  LinearKind kind;
  torch::Tensor weight;  // bf16 [out, in], or packed block tiles (quant_gemv.cpp)
  c10::optional<torch::Tensor> bias;
  int64_t out_features;
  int64_t activation_bits;
  int64_t kernel_max_rows;              // bf16: larger inputs go to at::linear (oneDNN GEMM); -1: no limit
  c10::optional<torch::Tensor> layout;  // blocks: the (GGML block type, rows) of each stacked matrix

  torch::Tensor operator()(const torch::Tensor& x) const {
    if (kind == LinearKind::Bf16) {
      if (kernel_max_rows >= 0 && x.size(0) > kernel_max_rows) return at::linear(x, weight, bias);
      return bf16_linear(x, weight, bias);
    }
    torch::Tensor y = quant_gemv(x, weight, *layout, activation_bits);
    if (bias) y.add_(*bias);
    return y;
  }
};

Linear make_linear(const pybind11::tuple& spec) {
  TORCH_CHECK(spec.size() == 7,
              "a linear spec is (kind, weight, bias, out_features, activation_bits, kernel_max_rows, layout)");
  Linear linear{static_cast<LinearKind>(spec[0].cast<int64_t>()),
                spec[1].cast<torch::Tensor>(),
                spec[2].cast<c10::optional<torch::Tensor>>(),
                spec[3].cast<int64_t>(),
                spec[4].cast<int64_t>(),
                spec[5].cast<int64_t>(),
                spec[6].cast<c10::optional<torch::Tensor>>()};
  TORCH_CHECK(linear.kind == LinearKind::Bf16 || linear.layout, "a block linear's spec needs its layout");
  return linear;
}

class DecodeLayer {
 public:
  DecodeLayer(const pybind11::tuple& qkv, const pybind11::tuple& o, const pybind11::tuple& gate_up,
              const pybind11::tuple& down, torch::Tensor input_norm, torch::Tensor post_norm, double eps, int64_t heads,
              int64_t kv_heads, int64_t head_dim, double scale)
      : qkv_(make_linear(qkv)),
        o_(make_linear(o)),
        gate_up_(make_linear(gate_up)),
        down_(make_linear(down)),
        input_norm_(std::move(input_norm)),
        post_norm_(std::move(post_norm)),
        eps_(eps),
        heads_(heads),
        kv_heads_(kv_heads),
        head_dim_(head_dim),
        scale_(scale) {}

  // x: [tokens, hidden], the layer's input before its norm; residual: the running residual
  // (None at the first layer). Returns (output, residual) like DecoderLayer.forward.
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                                   const torch::Tensor& positions, const torch::Tensor& cos,
                                                   const torch::Tensor& sin, torch::Tensor k_cache,
                                                   torch::Tensor v_cache, const torch::Tensor& slots,
                                                   const torch::Tensor& block_tables, const torch::Tensor& seq_info,
                                                   const c10::optional<torch::Tensor>& k_scale,
                                                   const c10::optional<torch::Tensor>& v_scale) const {
    torch::Tensor res;
    if (residual) {
      res = *residual;
      add_rms_norm(x, res, input_norm_, eps_);
    } else {
      res = x;
      x = torch::empty_like(res);
      rms_norm(x, res, input_norm_, eps_);
    }
    const int64_t n = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const torch::Tensor qkv = linear(0, qkv_, x);
    torch::Tensor q = qkv.narrow(1, 0, q_size).view({n, heads_, head_dim_});
    torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({n, kv_heads_, head_dim_});
    const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, kv_heads_, head_dim_});
    rotary_inplace(q, k, positions, cos, sin);
    write_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale);
    torch::Tensor attn = torch::empty({n, heads_, head_dim_}, qkv.options());
    paged_attention(attn, q, k_cache, v_cache, block_tables, seq_info, scale_, k_scale, v_scale);
    torch::Tensor h = linear(1, o_, attn.view({n, q_size}));
    add_rms_norm(h, res, post_norm_, eps_);
    return {linear(3, down_, silu_mul(linear(2, gate_up_, h))), res};
  }

  // The adapters of the step `step` (set once per step) and of this layer's qkv, o, gate_up and down
  // linears, applied after each of them from now on.
  void set_lora(std::shared_ptr<LoRAStep> step, std::shared_ptr<LoRASlots> qkv, std::shared_ptr<LoRASlots> o,
                std::shared_ptr<LoRASlots> gate_up, std::shared_ptr<LoRASlots> down) {
    TORCH_CHECK(step && qkv && o && gate_up && down, "set_lora needs the step and the four linears' adapters");
    lora_step_ = std::move(step);
    lora_ = {std::move(qkv), std::move(o), std::move(gate_up), std::move(down)};
  }

 private:
  torch::Tensor linear(int index, const Linear& base, const torch::Tensor& x) const {
    if (!lora_step_ || lora_step_->slots.empty()) return base(x);
    // A block linear's adapters run in its own parallel region, each thread expanding the columns it
    // computed, rather than after it (one row: on one thread while the other waits;
    // docs/design_measurements.md#lora-adapters-inside-the-quantized-linears-region). With a bias they
    // run after it, where the module path adds them.
    if (base.kind == LinearKind::Blocks && !base.bias) {
      LinearEpilogue epilogue;
      if (!lora_[index]->epilogue(x, base.out_features, *lora_step_, epilogue)) return base(x);
      return quant_gemv_then(x, base.weight, *base.layout, base.activation_bits, epilogue);
    }
    torch::Tensor y = base(x);
    lora_[index]->apply(y, x, *lora_step_);
    return y;
  }

  Linear qkv_, o_, gate_up_, down_;
  torch::Tensor input_norm_, post_norm_;
  double eps_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_;
  std::shared_ptr<const LoRAStep> lora_step_;
  std::array<std::shared_ptr<const LoRASlots>, 4> lora_;
};

}  // namespace

void register_decode_layer(pybind11::module_& m) {
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(
          pybind11::init<const pybind11::tuple&, const pybind11::tuple&, const pybind11::tuple&, const pybind11::tuple&,
                         torch::Tensor, torch::Tensor, double, int64_t, int64_t, int64_t, double>())
      .def("forward", &DecodeLayer::forward, pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("positions"),
           pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
           pybind11::arg("slots"), pybind11::arg("block_tables"), pybind11::arg("seq_info"),
           pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none(), ReleaseGil())
      .def("set_lora", &DecodeLayer::set_lora, pybind11::arg("step"), pybind11::arg("qkv"), pybind11::arg("o"),
           pybind11::arg("gate_up"), pybind11::arg("down"));
}
