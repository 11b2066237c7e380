// bf16 matrix products y = x @ W^T (+ bias), with x [..., in] and W [out, in] in bf16, fp32
// accumulation and y [..., out] rounded to bf16: the matrix-vector products of decoding, and (with
// --deterministic) every row count, since each output is summed in one order however many tokens
// share the call (batch invariance, docs/determinism.md).
//
// For one token a linear layer is a single pass over its weight, so its speed is memory bandwidth.
// The weight stays in PyTorch's own row-major [out, in] layout: each row is contiguous, so no
// packed copy is needed (a tied LM head reads the embedding table itself). kRows output rows are
// computed together, each step loading a run of each of those rows once for up to kTokens token
// rows, so that each weight load serves every token of the pass; every (row, token) has its own
// vector accumulator, whose lanes are summed once at the end. A thread's rows form one contiguous
// range of memory, requested ahead by software prefetches (see dot_block).
//
// Two instruction sets, each with its own summation order (the same on every call of one build):
// - AVX512-BF16: 32 bf16 per step and register, multiplied and summed in pairs by VDPBF16PS into
//   16 fp32 lanes; 4 x 4 outputs reduced at once (store_4x4). A ragged end is a masked load.
// - AVX2 + FMA (AMD Zen 2/3, Intel client cores, Xeons before Sapphire Rapids): bf16 is the
//   upper half of an fp32, so 16 bf16 become two fp32 vectors by interleaving them with zeros
//   (VPUNPCKLWD / VPUNPCKHWD), and FMAs sum them. Weights are widened as they stream; each chunk's
//   inputs once, into a buffer in the same interleaved order. 4 rows x 2 tokens: 8 accumulators,
//   2 input vectors, a widened weight and zeros in the 16 ymm registers (3 tokens spilled: 0.65x
//   the speed at 128 rows).
// Elsewhere a scalar loop of the same structure computes the same products (correct but ~8x
// slower than oneDNN: bf16_linear_vectorized tells callers which one was built).
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

#if defined(__AVX512BF16__)
#define BF16_GEMV_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define BF16_GEMV_AVX2
#endif
#if defined(BF16_GEMV_AVX512) || defined(BF16_GEMV_AVX2)
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

constexpr int kRows = 4;  // weight rows streamed together (a block's outputs are stored 4 at a time)
// Token rows per pass over a block of weight rows: kRows * kTokens accumulators, as many as the
// registers hold beside a weight vector or two (32 zmm; 16 ymm).
#if defined(BF16_GEMV_AVX2)
constexpr int kTokens = 2;
constexpr int64_t kInputBytes = 4;  // the kernel reads inputs widened to fp32
#else
constexpr int kTokens = 4;
constexpr int64_t kInputBytes = 2;
#endif
// Smallest share of the weight worth a thread: below it the pool's wake-up costs more than it saves.
constexpr int64_t kMinBytesPerTask = 64 * 1024;
// Input bytes of the tokens one pass over the weight serves (a share of L2).
constexpr int64_t kChunkBytes = 256 * 1024;
// Rows ahead of the current ones whose weights are requested (two blocks).
constexpr int64_t kPrefetchRows = 2 * kRows;

struct Problem {
  const bf16* x;
  int64_t x_stride;
  const bf16* w;
  int64_t w_stride;
  bf16* y;
  int64_t y_stride;
  const float* bias_f32;  // at most one of the two biases is set
  const bf16* bias_bf16;
  int64_t in;
  const float* x32;  // AVX2: the chunk's inputs widened by widen_inputs, x32_stride floats apart
  int64_t x32_stride;

  float bias(int64_t row) const {
    return bias_f32 ? bias_f32[row] : bias_bf16 ? static_cast<float>(bias_bf16[row]) : 0.0f;
  }
  void store(int64_t token, int64_t row, float sum) const {
    y[token * y_stride + row] = static_cast<bf16>(sum + bias(row));
  }
};

#if defined(BF16_GEMV_AVX512)

inline __m512bh load_bf16x32(const bf16* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bf16x32(const bf16* p, __mmask32 mask) { return (__m512bh)_mm512_maskz_loadu_epi16(mask, p); }

// Outputs of 4 weight rows x 4 tokens at once: a[j], b[j], c[j], d[j] are the accumulators of rows
// row .. row + 3 for token + j. A tree of shuffles sums all 16 vectors' lanes together, adding each
// vector's lanes in the order _mm512_reduce_add_ps does (lane i with i + 8, then i + 4, i + 2,
// i + 1), so every output has the bits of the one-at-a-time path, in about a quarter of its
// instructions (at prefill sizes those reductions were a large share of the kernel's time). The
// bias is added and the sums rounded to bf16 as Problem::store does (nearest even, NaN kept).
__attribute__((always_inline)) inline void store_4x4(const Problem& p, int64_t row, int64_t token, const __m512* a,
                                                     const __m512* b, const __m512* c, const __m512* d) {
  const __m512* rows[4] = {a, b, c, d};
  __m512 s1[8];  // s1[i]: vectors 2i, 2i + 1 with v[4r + j] = rows[r][j]; lane i + 8 folded onto lane i
  for (int i = 0; i < 8; ++i) {
    const __m512 x = rows[i / 2][2 * (i % 2)], y = rows[i / 2][2 * (i % 2) + 1];
    s1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  __m512 s2[4];  // 128-bit quarter q of s2[i]: vector 4i + q, lane i + 4 folded onto lane i
  for (int i = 0; i < 4; ++i)
    s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0x88),
                          _mm512_shuffle_f32x4(s1[2 * i], s1[2 * i + 1], 0xDD));
  __m512 s3[2];  // quarter q of s3[i]: vectors 8i + q and 8i + 4 + q, two partial sums each
  for (int i = 0; i < 2; ++i) {
    const __m512d x = _mm512_castps_pd(s2[2 * i]), y = _mm512_castps_pd(s2[2 * i + 1]);
    s3[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Lane 4q + e: the sum of vector 4e + q, i.e. token j = q, weight row r = e.
  __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  if (p.bias_f32 || p.bias_bf16) {
    alignas(16) float bias[4];
    for (int r = 0; r < 4; ++r) bias[r] = p.bias(row + r);
    sums = _mm512_add_ps(sums, _mm512_broadcast_f32x4(_mm_load_ps(bias)));
  }
  // Round to nearest even as c10::BFloat16 does: add 0x7FFF plus the lowest kept bit, keep the high half.
  const __m512i bits = _mm512_castps_si512(sums);
  const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lowest_kept, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(sums, sums, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  alignas(32) uint64_t halves[4];  // token j's four outputs: 4 bf16 in one 64-bit word
  _mm256_store_si256(reinterpret_cast<__m256i*>(halves), _mm512_cvtepi32_epi16(rounded));
  for (int j = 0; j < 4; ++j) std::memcpy(p.y + (token + j) * p.y_stride + row, &halves[j], sizeof(uint64_t));
}

// Rows [row, row + R) of y for tokens [token, token + T).
template <int R, int T>
void dot_block(const Problem& p, int64_t row, int64_t token, int64_t pass, int64_t passes) {
  __m512 acc[R][T];
  bool prefetch[R];
  for (int r = 0; r < R; ++r) prefetch[r] = r % passes == pass;
  const bf16* w[R];
  const bf16* x[T];
  for (int r = 0; r < R; ++r) w[r] = p.w + (row + r) * p.w_stride;
  for (int t = 0; t < T; ++t) x[t] = p.x + (token + t) * p.x_stride;
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();

  const int64_t full = p.in / 32 * 32;
  for (int64_t k = 0; k < full; k += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_bf16x32(w[r] + k);
    // The hardware prefetchers lose track of kRows short interleaved streams; ask for the same
    // line kPrefetchRows rows ahead, into L2 (prefetcht0, into L1, measured no faster than none).
    for (int r = 0; r < R; ++r)
      if (prefetch[r]) _mm_prefetch(reinterpret_cast<const char*>(w[r] + kPrefetchRows * p.w_stride + k), _MM_HINT_T1);
    for (int t = 0; t < T; ++t) {
      const __m512bh xv = load_bf16x32(x[t] + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
    }
  }
  if (full < p.in) {
    const __mmask32 mask = _cvtu32_mask32((1u << (p.in - full)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_bf16x32(w[r] + full, mask);
    for (int t = 0; t < T; ++t) {
      const __m512bh xv = load_bf16x32(x[t] + full, mask);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
    }
  }
  if constexpr (R == 4 && T == 4) {
    store_4x4(p, row, token, acc[0], acc[1], acc[2], acc[3]);
  } else {
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) p.store(token + t, row + r, _mm512_reduce_add_ps(acc[r][t]));
  }
}

#elif defined(BF16_GEMV_AVX2)

constexpr int64_t kStep = 16;  // bf16 per weight load: one ymm, widened to two

// Lanes (0-3, 8-11) and (4-7, 12-15) of 16 bf16 as fp32: interleaving zeros below each value
// (within 128-bit halves, as VPUNPCK*WD works) makes it the upper half of its 32-bit lane. Weights
// and inputs pass through the same shuffle, so their lanes still pair up.
inline __m256 widen_lo(__m256i v) { return _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v)); }
inline __m256 widen_hi(__m256i v) { return _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v)); }
inline __m256i load_bf16x16(const bf16* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The ragged end of a row (count < 16 values), zero-filled into `out`: AVX2 has no 16-bit masked load.
inline const bf16* padded_tail(const bf16* p, int64_t count, uint16_t (&out)[kStep]) {
  std::memset(out, 0, sizeof(out));
  std::memcpy(out, p, count * sizeof(bf16));
  return reinterpret_cast<const bf16*>(out);
}

// Token rows [begin, end) of p.x widened into `out` (x32_stride floats per row; zeros past p.in).
void widen_inputs(const Problem& p, int64_t begin, int64_t end, float* out) {
  for (int64_t t = begin; t < end; ++t) {
    const bf16* x = p.x + t * p.x_stride;
    float* o = out + t * p.x32_stride;
    for (int64_t k = 0; k < p.in; k += kStep) {
      alignas(32) uint16_t tail[kStep];
      const __m256i v = load_bf16x16(k + kStep <= p.in ? x + k : padded_tail(x + k, p.in - k, tail));
      _mm256_storeu_ps(o + k, widen_lo(v));
      _mm256_storeu_ps(o + k + 8, widen_hi(v));
    }
  }
}

// One step of 16 inputs: w[r] points at row r's 16 weights, x[t] + k at token t's widened inputs.
// Each half of the inputs is held in registers while every row's weights (widened straight from
// memory) multiply it; each accumulator takes the low half, then the high: one order for all R, T.
template <int R, int T>
__attribute__((always_inline)) inline void fma_step(__m256 (&acc)[R][T], const bf16* const (&w)[R],
                                                    const float* const (&x)[T], int64_t k) {
  for (int half = 0; half < 2; ++half) {
    __m256 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = _mm256_loadu_ps(x[t] + k + 8 * half);
    for (int r = 0; r < R; ++r) {
      const __m256i wv = load_bf16x16(w[r]);
      const __m256 wf = half == 0 ? widen_lo(wv) : widen_hi(wv);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm256_fmadd_ps(wf, xv[t], acc[r][t]);
    }
  }
}

// Lane i of the result: the sum of v[i]'s lanes, ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), the
// order sum8 gives a single vector.
inline __m128 sums4(const __m256* v) {
  const __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  return _mm_add_ps(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1));
}
inline float sum8(__m256 v) {
  const __m256 h = _mm256_hadd_ps(v, v);
  const __m256 q = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}

// One token's outputs of rows row .. row + 3: the bias added and the sums rounded to bf16 as
// Problem::store does (nearest even, NaN kept).
inline void store_4(const Problem& p, int64_t row, int64_t token, __m128 sums, __m128 bias) {
  sums = _mm_add_ps(sums, bias);
  const __m128i bits = _mm_castps_si128(sums);
  const __m128i lowest_kept = _mm_and_si128(_mm_srli_epi32(bits, 16), _mm_set1_epi32(1));
  __m128i rounded = _mm_srli_epi32(_mm_add_epi32(bits, _mm_add_epi32(lowest_kept, _mm_set1_epi32(0x7FFF))), 16);
  const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(sums, sums));
  rounded = _mm_blendv_epi8(rounded, _mm_set1_epi32(0x7FC0), nan);
  const int64_t halves = _mm_cvtsi128_si64(_mm_packus_epi32(rounded, rounded));  // values <= 0xFFFF
  std::memcpy(p.y + token * p.y_stride + row, &halves, sizeof(halves));
}

// Rows [row, row + R) of y for tokens [token, token + T).
template <int R, int T>
void dot_block(const Problem& p, int64_t row, int64_t token, int64_t pass, int64_t passes) {
  __m256 acc[R][T];
  bool prefetch[R];
  for (int r = 0; r < R; ++r) prefetch[r] = r % passes == pass;
  const bf16* w[R];
  const float* x[T];
  for (int r = 0; r < R; ++r) w[r] = p.w + (row + r) * p.w_stride;
  for (int t = 0; t < T; ++t) x[t] = p.x32 + (token + t) * p.x32_stride;
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();

  const bf16* wk[R];
  auto step = [&](int64_t k) {
    for (int r = 0; r < R; ++r) wk[r] = w[r] + k;
    fma_step(acc, wk, x, k);
  };
  const int64_t full = p.in / kStep * kStep;
  int64_t k = 0;
  for (; k + 2 * kStep <= full; k += 2 * kStep) {  // 64 bytes of each row: one prefetch per line
    // As in the AVX-512 path: the same line kPrefetchRows rows ahead, into L2.
    for (int r = 0; r < R; ++r)
      if (prefetch[r]) _mm_prefetch(reinterpret_cast<const char*>(w[r] + kPrefetchRows * p.w_stride + k), _MM_HINT_T1);
    step(k);
    step(k + kStep);
  }
  if (k < full) step(k);
  if (full < p.in) {
    alignas(32) uint16_t tails[R][kStep];
    for (int r = 0; r < R; ++r) wk[r] = padded_tail(w[r] + full, p.in - full, tails[r]);
    fma_step(acc, wk, x, full);
  }
  if constexpr (R == 4) {
    const __m128 bias = _mm_setr_ps(p.bias(row), p.bias(row + 1), p.bias(row + 2), p.bias(row + 3));
    for (int t = 0; t < T; ++t) {
      const __m256 column[4] = {acc[0][t], acc[1][t], acc[2][t], acc[3][t]};
      store_4(p, row, token + t, sums4(column), bias);
    }
  } else {
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) p.store(token + t, row + r, sum8(acc[r][t]));
  }
}

#else

// Portable fallback: the same blocking, one fp32 accumulator per (row, token).
template <int R, int T>
void dot_block(const Problem& p, int64_t row, int64_t token, int64_t /*pass*/, int64_t /*passes*/) {
  float acc[R][T] = {};
  for (int64_t k = 0; k < p.in; ++k) {
    float wv[R];
    for (int r = 0; r < R; ++r) wv[r] = static_cast<float>(p.w[(row + r) * p.w_stride + k]);
    for (int t = 0; t < T; ++t) {
      const float xv = static_cast<float>(p.x[(token + t) * p.x_stride + k]);
      for (int r = 0; r < R; ++r) acc[r][t] += wv[r] * xv;
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) p.store(token + t, row + r, acc[r][t]);
}

#endif

// count (1 .. kTokens) tokens from `token` on.
template <int R, int T = kTokens>
void dot_pass(const Problem& p, int64_t row, int64_t token, int64_t count, int64_t pass, int64_t passes) {
  if constexpr (T > 1) {
    if (count < T) return dot_pass<R, T - 1>(p, row, token, count, pass, passes);
  }
  dot_block<R, T>(p, row, token, pass, passes);
}

// All tokens for rows [row, row + R): ceil(tokens / kTokens) passes, full ones first (with AVX-512
// 9 tokens run as 4 + 4 + 1: a full pass stores its outputs through store_4x4). After the first
// pass the block's rows come from L1; the passes share the prefetching of the rows ahead (pass i
// requests rows r with r % passes == i), so that memory stays busy during every pass, not only the
// first.
template <int R>
void dot_rows(const Problem& p, int64_t row, int64_t tokens) {
  const int64_t passes = (tokens + kTokens - 1) / kTokens;
  for (int64_t i = 0, token = 0; i < passes; ++i) {
    const int64_t count = std::min<int64_t>(kTokens, tokens - token);
    dot_pass<R>(p, row, token, count, i, passes);
    token += count;
  }
}

}  // namespace

torch::Tensor bf16_linear(const torch::Tensor& input, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& bias) {
  RECORD_FUNCTION("native::bf16_gemv", c10::ArrayRef<const c10::IValue>{});
  TORCH_CHECK(input.device().is_cpu() && weight.device().is_cpu(), "bf16_linear: CPU tensors only");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16_linear: x and weight must be bfloat16");
  TORCH_CHECK(weight.dim() == 2 && weight.stride(1) == 1,
              "bf16_linear: weight must be 2-D [out, in] with contiguous rows");
  const int64_t in = weight.size(1), out = weight.size(0);
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == in, "bf16_linear: x has ", input.size(-1),
              " features, weight expects ", in);
  // x as [tokens, in] with contiguous rows (a view whenever its layout allows).
  torch::Tensor x = input.reshape({-1, in});
  if (x.stride(1) != 1) x = x.contiguous();
  const int64_t tokens = x.size(0);
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = out;

  Problem p{};
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->is_contiguous() && bias->numel() == out,
                "bf16_linear: bias must be a contiguous CPU tensor of ", out, " values");
    if (bias->scalar_type() == at::kFloat)
      p.bias_f32 = bias->data_ptr<float>();
    else if (bias->scalar_type() == at::kBFloat16)
      p.bias_bf16 = bias->data_ptr<bf16>();
    else
      TORCH_CHECK(false, "bf16_linear: bias must be float32 or bfloat16");
  }
  torch::Tensor y = torch::empty(out_shape, x.options());
  if (tokens == 0 || out == 0) return y;
  p.x = x.data_ptr<bf16>();
  p.x_stride = x.stride(0);
  p.w = weight.data_ptr<bf16>();
  p.w_stride = weight.stride(0);
  p.y = y.data_ptr<bf16>();
  p.y_stride = out;
  p.in = in;

  const int64_t blocks = (out + kRows - 1) / kRows;
  const int64_t block_bytes = kRows * std::max<int64_t>(in, 1) * 2;
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerTask / block_bytes);
  // Many tokens (a prefill chunk) go `chunk` at a time, so that their inputs stay in L2 while
  // every block of weight rows passes over them. Each output is summed the same way whatever the
  // chunking: a token's result never depends on the other tokens (batch invariance).
  const int64_t chunk = std::max<int64_t>(kTokens, kChunkBytes / (kInputBytes * std::max<int64_t>(in, 1)));
#if defined(BF16_GEMV_AVX2)
  p.x32_stride = (in + kStep - 1) / kStep * kStep;
  // One chunk's widened inputs, reused across calls (resized only to grow). The pool's threads
  // reach it through `widened`: a thread_local named inside them would be their own.
  thread_local std::vector<float> buffer;
  buffer.resize(std::max<size_t>(buffer.size(), std::min(chunk, tokens) * p.x32_stride));
  float* const widened = buffer.data();
  p.x32 = widened;
#endif
  for (int64_t first = 0; first < tokens; first += chunk) {
    Problem part = p;
    part.x = p.x + first * p.x_stride;
    part.y = p.y + first * p.y_stride;
    const int64_t count = std::min(chunk, tokens - first);
#if defined(BF16_GEMV_AVX2)
    const int64_t widen_grain = std::max<int64_t>(1, kMinBytesPerTask / (kInputBytes * p.x32_stride));
    at::parallel_for(0, count, widen_grain,
                     [&](int64_t begin, int64_t end) { widen_inputs(part, begin, end, widened); });
#endif
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const int64_t row = b * kRows;
        if (row + kRows <= out) {
          dot_rows<kRows>(part, row, count);
        } else {
          for (int64_t r = row; r < out; ++r) dot_rows<1>(part, r, count);
        }
      }
    });
  }
  return y;
}

void register_bf16_gemv(pybind11::module_& m) {
  m.def("bf16_linear", &bf16_linear,
        "y[..., out] = x[..., in] @ weight[out, in]^T (+ bias) in bf16 with fp32 sums, for few-token inputs",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none(), ReleaseGil());
#if defined(BF16_GEMV_AVX512)
  m.attr("bf16_linear_isa") = "avx512_bf16";
#elif defined(BF16_GEMV_AVX2)
  m.attr("bf16_linear_isa") = "avx2";
#else
  m.attr("bf16_linear_isa") = "scalar";
#endif
  // Whether the kernel beats the linears PyTorch has here (the scalar loop does not).
#if defined(BF16_GEMV_AVX512) || defined(BF16_GEMV_AVX2)
  m.attr("bf16_linear_vectorized") = true;
#else
  m.attr("bf16_linear_vectorized") = false;
#endif
}
