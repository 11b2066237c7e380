// An encoder step's attention (BERT): the step's inputs packed one after another, [tokens, heads,
// head_dim], each input's queries attending bidirectionally to its own keys only, no KV cache.
//
// The inputs are read where they lie (q, k and v may be strided views of one fused QKV projection)
// and the output written packed, so nothing is padded or gathered: a step of short sentences of
// many lengths is one call per layer. A work item is one (input, head): its keys are transposed to
// fp32 [head_dim][length] so that a query's scores are vectors of 16 keys' dot products, its values
// converted to fp32 [length][head_dim]; each query then takes the exact softmax over its whole input
// (lengths are bounded by the model's position table, a few hundred) and its weighted values. Sums
// are fp32 whatever the input dtype, each in one fixed order, so an input's result depends on nothing
// but the input: not the other inputs of the step, their order, nor the thread count
// (docs/determinism.md). Items differ in cost (quadratic in the length), so threads take them
// longest first from a shared counter.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <algorithm>
#include <atomic>
#include <numeric>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace {

// Scratch of one thread: an item's transposed keys, values, one query's scores and weighted values.
struct Scratch {
  std::vector<float> keys_t, values, query, scores, acc;
  void fit(int64_t length, int64_t head_dim) {
    const int64_t padded = (length + 15) / 16 * 16;  // whole vectors of keys; the tail's scores unused
    if (static_cast<int64_t>(keys_t.size()) < head_dim * padded) keys_t.assign(head_dim * padded, 0.0f);
    if (static_cast<int64_t>(values.size()) < length * head_dim) values.resize(length * head_dim);
    if (static_cast<int64_t>(scores.size()) < padded) scores.resize(padded);
    query.resize(head_dim);
    acc.resize(head_dim);
  }
};

template <typename scalar_t>
void attend_item(Scratch& s, const scalar_t* q, const scalar_t* k, const scalar_t* v, scalar_t* out, int64_t q_stride,
                 int64_t k_stride, int64_t v_stride, int64_t out_stride, int64_t length, int64_t head_dim,
                 float scale) {
  const int64_t padded = (length + 15) / 16 * 16;
  s.fit(length, head_dim);
  float* keys_t = s.keys_t.data();
  float* values = s.values.data();
  for (int64_t t = 0; t < length; ++t)
    for (int64_t d = 0; d < head_dim; ++d) {
      keys_t[d * padded + t] = static_cast<float>(k[t * k_stride + d]);
      values[t * head_dim + d] = static_cast<float>(v[t * v_stride + d]);
    }
  float* query = s.query.data();
  float* scores = s.scores.data();
  float* acc = s.acc.data();
  for (int64_t i = 0; i < length; ++i) {
    for (int64_t d = 0; d < head_dim; ++d) query[d] = static_cast<float>(q[i * q_stride + d]) * scale;
    // scores[t] = query . key t, summed over d in order for every t (vectorised across keys).
    std::fill(scores, scores + padded, 0.0f);
    for (int64_t d = 0; d < head_dim; ++d) {
      const float qd = query[d];
      const float* kd = keys_t + d * padded;
      for (int64_t t = 0; t < padded; ++t) scores[t] += qd * kd[t];
    }
    const float peak = *std::max_element(scores, scores + length);
    const float sum = exp_shifted_sum(scores, scores, length, peak);
    std::fill(acc, acc + head_dim, 0.0f);
    for (int64_t t = 0; t < length; ++t) {
      const float w = scores[t];
      const float* vt = values + t * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) acc[d] += w * vt[d];
    }
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < head_dim; ++d) out[i * out_stride + d] = static_cast<scalar_t>(acc[d] * inv);
  }
}

void check_rows(const torch::Tensor& t, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.sizes() == like.sizes(), name, " must be [tokens, heads, head_dim] like q");
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have q's dtype");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), name, "'s heads must be contiguous within a row");
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

}  // namespace

void encoder_attention(torch::Tensor out, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& seq_starts, double scale) {
  RECORD_FUNCTION("native::encoder_attention", c10::ArrayRef<const c10::IValue>{});
  check_rows(q, q, "q");
  check_rows(k, q, "k");
  check_rows(v, q, "v");
  check_rows(out, q, "out");
  TORCH_CHECK(seq_starts.dim() == 1 && seq_starts.scalar_type() == at::kLong && seq_starts.is_contiguous() &&
                  seq_starts.size(0) >= 1,
              "seq_starts must be a contiguous int64 [inputs + 1]");
  const int64_t tokens = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t* starts = seq_starts.data_ptr<int64_t>();
  const int64_t inputs = seq_starts.size(0) - 1;
  TORCH_CHECK(starts[0] == 0 && starts[inputs] <= tokens, "seq_starts must run from 0 to at most the token count");
  for (int64_t b = 0; b < inputs; ++b) TORCH_CHECK(starts[b] < starts[b + 1], "every input must have a token");

  // Longest inputs first: the costly items start early and the short ones fill the threads' ends.
  std::vector<int64_t> order(inputs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return starts[a + 1] - starts[a] > starts[b + 1] - starts[b]; });
  const int64_t items = inputs * heads;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(items, 1));
  std::atomic<int64_t> next{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "encoder_attention", [&] {
    const scalar_t *qp = q.data_ptr<scalar_t>(), *kp = k.data_ptr<scalar_t>(), *vp = v.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      Scratch scratch;
      for (int64_t item = next++; item < items; item = next++) {
        const int64_t b = order[item / heads], h = item % heads;
        const int64_t first = starts[b], length = starts[b + 1] - first;
        attend_item(scratch, qp + first * q.stride(0) + h * head_dim, kp + first * k.stride(0) + h * head_dim,
                    vp + first * v.stride(0) + h * head_dim, op + first * out.stride(0) + h * head_dim, q.stride(0),
                    k.stride(0), v.stride(0), out.stride(0), length, head_dim, static_cast<float>(scale));
      }
    });
    // Rows after the last input (the step's padding) belong to no input: zeros, never garbage.
    for (int64_t t = starts[inputs]; t < tokens; ++t)
      std::fill(op + t * out.stride(0), op + t * out.stride(0) + heads * head_dim, static_cast<scalar_t>(0));
  });
}
