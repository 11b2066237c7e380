// Per-token fused operations of a decoder layer: RMSNorm (with the residual add), rotary
// embedding applied in place, and SiLU(gate) * up. Arithmetic in fp32; results are rounded to the
// model dtype at the same points as the PyTorch reference in models/layers.py, so fp32 results
// agree with it up to summation order.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <cmath>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace {

constexpr int64_t kRowsPerTask = 16;

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

template <typename T>
float inverse_rms(const T* x, int64_t n, double eps) {
  float lanes[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) {
      float v = static_cast<float>(x[i + l]);
      lanes[l] += v * v;
    }
  float sum = 0;
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  for (float v : lanes) sum += v;
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
}

template <typename T>
void normalize_row(T* out, const T* x, const T* w, int64_t n, float r) {
  for (int64_t i = 0; i < n; ++i) {
    T normed = static_cast<T>(static_cast<float>(x[i]) * r);
    out[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

}  // namespace

void rms_norm(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  RECORD_FUNCTION("native::rms_norm", c10::ArrayRef<const c10::IValue>{});
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() &&
              weight.scalar_type() == x.scalar_type());
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n, "weight must hold one value per feature");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = xp + r * xs;
        normalize_row(op + r * os, row, wp, n, inverse_rms(row, n, eps));
      }
    });
  });
}

void add_rms_norm(torch::Tensor x, torch::Tensor residual, const torch::Tensor& weight, double eps) {
  RECORD_FUNCTION("native::add_rms_norm", c10::ArrayRef<const c10::IValue>{});
  // residual <- x + residual; x <- norm(residual) * weight.
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
              weight.scalar_type() == x.scalar_type());
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == n, "weight must hold one value per feature");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), rs = residual.stride(0);
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* xr = xp + r * xs;
        scalar_t* rr = rp + r * rs;
        for (int64_t i = 0; i < n; ++i)
          rr[i] = static_cast<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        normalize_row(xr, rr, wp, n, inverse_rms(rr, n, eps));
      }
    });
  });
}

void rotary_inplace(torch::Tensor q, torch::Tensor k, const torch::Tensor& positions, const torch::Tensor& cos,
                    const torch::Tensor& sin) {
  RECORD_FUNCTION("native::rotary_inplace", c10::ArrayRef<const c10::IValue>{});
  // q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim] (row-strided views of the fused
  // qkv output); cos/sin: [max_positions, head_dim / 2]. Half-split (NeoX / HF) layout.
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "q and k must be [tokens, heads, head_dim]");
  TORCH_CHECK(q.stride(1) == q.size(2) && k.stride(1) == k.size(2), "heads of q and k must be contiguous");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == q.scalar_type() &&
              sin.scalar_type() == q.scalar_type());
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && positions.is_contiguous() &&
              positions.scalar_type() == at::kLong);
  const int64_t tokens = q.size(0), half = q.size(2) / 2;
  TORCH_CHECK(cos.size(1) == half, "cos/sin tables must have head_dim / 2 columns");
  const int64_t max_pos = cos.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_inplace", [&] {
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    auto rotate = [&](torch::Tensor& x, int64_t t) {
      scalar_t* base = x.data_ptr<scalar_t>() + t * x.stride(0);
      const scalar_t* c = cp + pos[t] * half;
      const scalar_t* s = sp + pos[t] * half;
      for (int64_t h = 0; h < x.size(1); ++h) {
        scalar_t* x1 = base + h * x.stride(1);
        scalar_t* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          // Each product is rounded to the model dtype first, as the eager reference does.
          float a = x1[i], b = x2[i];
          float ac = static_cast<scalar_t>(a * static_cast<float>(c[i]));
          float bs = static_cast<scalar_t>(b * static_cast<float>(s[i]));
          float bc = static_cast<scalar_t>(b * static_cast<float>(c[i]));
          float as = static_cast<scalar_t>(a * static_cast<float>(s[i]));
          x1[i] = static_cast<scalar_t>(ac - bs);
          x2[i] = static_cast<scalar_t>(bc + as);
        }
      }
    };
    at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotate(q, t);
        rotate(k, t);
      }
    });
  });
}

torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  RECORD_FUNCTION("native::silu_mul", c10::ArrayRef<const c10::IValue>{});
  check_rows(gate_up, "gate_up");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t gs = gate_up.stride(0);
    at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
      std::vector<float> gate(n);
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = gp + r * gs;
        const scalar_t* u = g + n;
        scalar_t* o = op + r * n;
        for (int64_t i = 0; i < n; ++i) gate[i] = static_cast<float>(g[i]);
        silu(gate.data(), gate.data(), n);
        for (int64_t i = 0; i < n; ++i) {
          // SiLU is rounded to the model dtype before the product, as the eager reference does.
          o[i] = static_cast<scalar_t>(static_cast<float>(static_cast<scalar_t>(gate[i])) * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}
