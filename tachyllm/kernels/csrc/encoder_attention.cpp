// An encoder step's attention (BERT): the step's inputs packed one after another, [tokens, heads,
// head_dim], each input's queries attending bidirectionally to its own keys only, no KV cache.
//
// The inputs are read where they lie (q, k and v may be strided views of one fused QKV projection)
// and the output written packed, so nothing is padded or gathered: a step of short sentences of
// many lengths is one call per layer. A work item is one (input, head): its keys are transposed to
// fp32 [head_dim][length] so that a query's scores are vectors of 16 keys' dot products, its values
// converted to fp32 [length][head_dim]; each query then takes the exact softmax over its whole input
// (lengths are bounded by the model's position table, a few hundred) and its weighted values, 8
// queries at a time with their sums in registers (AVX-512; plain loops elsewhere). Sums
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

// Queries go kRows at a time: their scores for 16 keys, or their weighted values (head_dim / 16
// vectors each), are accumulated in registers. Each row's sums run in one order whatever block it
// falls in (one accumulator per row and 16 keys, over d; per output vector, over keys), so a query's
// result does not depend on how many queries its input has.
constexpr int kRows = 8;

// Scratch of one thread: an item's transposed keys, values, one query's scores and weighted values.
struct Scratch {
  std::vector<float> keys_t, values, query, scores, acc;
  void fit(int64_t length, int64_t head_dim) {
    const int64_t padded = (length + 15) / 16 * 16;  // whole vectors of keys; the tail's scores unused
    if (static_cast<int64_t>(keys_t.size()) < head_dim * padded) keys_t.assign(head_dim * padded, 0.0f);
    if (static_cast<int64_t>(values.size()) < length * head_dim) values.resize(length * head_dim);
    if (static_cast<int64_t>(scores.size()) < kRows * padded) scores.resize(kRows * padded);
    query.resize(kRows * head_dim);
    acc.resize(kRows * head_dim);
  }
};

#if defined(__AVX512F__)
// scores[r][t0 .. t0 + 16) = query r . keys t0 .. t0 + 16 for N rows of queries [N][head_dim].
template <int N>
inline void score_tile(float* scores, int64_t padded, const float* query, const float* keys_t, int64_t t0,
                       int64_t head_dim) {
  __m512 acc[N];
  for (int r = 0; r < N; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    const __m512 k = _mm512_loadu_ps(keys_t + d * padded + t0);
    for (int r = 0; r < N; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(query[r * head_dim + d]), k, acc[r]);
  }
  for (int r = 0; r < N; ++r) _mm512_storeu_ps(scores + r * padded + t0, acc[r]);
}

// acc[r] = sum_t weights[r][t] * values[t] for N rows, P vectors of 16 per row.
template <int N, int P>
inline void weigh_values(float* acc, const float* weights, int64_t padded, const float* values, int64_t length) {
  __m512 a[N][P];
  for (int r = 0; r < N; ++r)
    for (int p = 0; p < P; ++p) a[r][p] = _mm512_setzero_ps();
  for (int64_t t = 0; t < length; ++t) {
    __m512 v[P];
    for (int p = 0; p < P; ++p) v[p] = _mm512_loadu_ps(values + t * P * 16 + p * 16);
    for (int r = 0; r < N; ++r) {
      const __m512 w = _mm512_set1_ps(weights[r * padded + t]);
      for (int p = 0; p < P; ++p) a[r][p] = _mm512_fmadd_ps(w, v[p], a[r][p]);
    }
  }
  for (int r = 0; r < N; ++r)
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(acc + r * P * 16 + p * 16, a[r][p]);
}

template <int N>
void scores_block(float* scores, int64_t padded, const float* query, const float* keys_t, int64_t head_dim) {
  for (int64_t t0 = 0; t0 < padded; t0 += 16) score_tile<N>(scores, padded, query, keys_t, t0, head_dim);
}

// The block's rows, N at a time, N * P accumulators and P values fitting the 32 vector registers.
template <int P>
void values_block(float* acc, const float* weights, int64_t padded, const float* values, int64_t length, int rows) {
  constexpr int N = P <= 2 ? kRows : (P <= 4 ? 4 : 2);
  int r = 0;
  for (; r + N <= rows; r += N) weigh_values<N, P>(acc + r * P * 16, weights + r * padded, padded, values, length);
  for (; r < rows; ++r) weigh_values<1, P>(acc + r * P * 16, weights + r * padded, padded, values, length);
}
#endif

// Scores of `rows` queries (at most kRows) against every key: [rows][padded].
void scores_for(float* scores, int64_t padded, const float* query, const float* keys_t, int64_t head_dim, int rows) {
#if defined(__AVX512F__)
  switch (rows) {
    case 8: return scores_block<8>(scores, padded, query, keys_t, head_dim);
    case 7: return scores_block<7>(scores, padded, query, keys_t, head_dim);
    case 6: return scores_block<6>(scores, padded, query, keys_t, head_dim);
    case 5: return scores_block<5>(scores, padded, query, keys_t, head_dim);
    case 4: return scores_block<4>(scores, padded, query, keys_t, head_dim);
    case 3: return scores_block<3>(scores, padded, query, keys_t, head_dim);
    case 2: return scores_block<2>(scores, padded, query, keys_t, head_dim);
    default: return scores_block<1>(scores, padded, query, keys_t, head_dim);
  }
#else
  for (int r = 0; r < rows; ++r) {
    float* sr = scores + r * padded;
    std::fill(sr, sr + padded, 0.0f);
    for (int64_t d = 0; d < head_dim; ++d) {
      const float qd = query[r * head_dim + d];
      const float* kd = keys_t + d * padded;
      for (int64_t t = 0; t < padded; ++t) sr[t] += qd * kd[t];
    }
  }
#endif
}

// Weighted values of `rows` queries: acc [rows][head_dim].
void values_for(float* acc, const float* weights, int64_t padded, const float* values, int64_t length, int64_t head_dim,
                int rows) {
#if defined(__AVX512F__)
  switch (head_dim) {
    case 16: return values_block<1>(acc, weights, padded, values, length, rows);
    case 32: return values_block<2>(acc, weights, padded, values, length, rows);
    case 48: return values_block<3>(acc, weights, padded, values, length, rows);
    case 64: return values_block<4>(acc, weights, padded, values, length, rows);
    case 128: return values_block<8>(acc, weights, padded, values, length, rows);
    default: break;  // other head sizes: the plain loops below
  }
#endif
  for (int r = 0; r < rows; ++r) {
    float* ar = acc + r * head_dim;
    std::fill(ar, ar + head_dim, 0.0f);
    for (int64_t t = 0; t < length; ++t) {
      const float w = weights[r * padded + t];
      const float* vt = values + t * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) ar[d] += w * vt[d];
    }
  }
}

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
  for (int64_t i0 = 0; i0 < length; i0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, length - i0));
    for (int r = 0; r < rows; ++r)
      for (int64_t d = 0; d < head_dim; ++d)
        query[r * head_dim + d] = static_cast<float>(q[(i0 + r) * q_stride + d]) * scale;
    scores_for(scores, padded, query, keys_t, head_dim, rows);
    float sums[kRows];
    for (int r = 0; r < rows; ++r) {
      float* sr = scores + r * padded;
      const float peak = *std::max_element(sr, sr + length);
      sums[r] = exp_shifted_sum(sr, sr, length, peak);
    }
    values_for(acc, scores, padded, values, length, head_dim, rows);
    for (int r = 0; r < rows; ++r) {
      const float inv = 1.0f / sums[r];
      scalar_t* o = out + (i0 + r) * out_stride;
      for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<scalar_t>(acc[r * head_dim + d] * inv);
    }
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
