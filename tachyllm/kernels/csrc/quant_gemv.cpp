// Quantized matrix-vector products over GGUF-style 32-weight blocks: Q4_1 (w = d*q + m, q in 0..15)
// and Q8_0 (w = d*q, q in -128..127), with activations quantized per 32-block to int8 (llama.cpp's
// Q8_1: s = max|x| / 127, plus s * sum(q) per block), so every block is one integer dot product;
// or, with activation_bits=16, to two int8 parts (the residual in units of s/256), two dot products.
// Each activation row is rounded and accumulated on its own, in a fixed order: a row's result does
// not depend on the other rows of the batch nor on the number of threads.
//
// Portable scalar code reads the same layout where AVX-512 VNNI is missing (correct, not fast: the
// Python side then prefers aten's int4 kernel, see quantization/int4.py).
//
// Packed layout ("tiles"): 16 output rows are interleaved so that int32 lane j of an AVX-512
// register accumulates row j. For tile t and block b, one contiguous chunk holds
//   Q4_1 (320 bytes): 4 x 64 bytes of nibbles, 16 fp16 d, 16 fp16 m
//   Q8_0 (544 bytes): 8 x 64 bytes of codes stored as u = q + 128, 16 fp16 d
// In nibble chunk c, byte 4j+i holds row j's weight 4c+i (low nibble) and 16+4c+i (high nibble);
// in Q8_0 chunk c, byte 4j+i holds row j's weight 4c+i. One VPDPBUSD (u8 weights x s8 activations)
// then adds 4 products for each of the 16 rows, with the 4 activations broadcast to every lane:
// no horizontal sums, and the per-row scales d, m load as one vector. The tiles of a matrix follow
// each other in row order, blocks in input order: each thread streams one contiguous range.
// Q8_0's +128 offset is undone with the block's activation sum: d*s*dot(q, x) =
// d * (s*dot(u, x) - 128 * s*sum(x)), i.e. Q8_0 is Q4_1's formula with 8-bit codes and m = -128 d.
// Rows past the matrix's end (out_features not a multiple of 16) are zero and never stored.
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QGEMV_AVX512 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;    // weights per block
constexpr int64_t TILE = 16;  // output rows per tile: one 32-bit lane each
constexpr int64_t Q4_1_BYTES = TILE * QK / 2 + 2 * TILE * 2;  // 320
constexpr int64_t Q8_0_BYTES = TILE * QK + TILE * 2;          // 544
// Activation rows sharing one decoded weight block (accumulators held in registers).
constexpr int ROWS = 4;
// Activation rows per pass over a thread's tiles: their int8 copy stays in L1/L2 while the weights
// stream; only prefill-sized inputs take more than one pass.
constexpr int64_t ROW_CHUNK = 64;

enum class Kind { Q4_1, Q8_0 };

int64_t block_bytes(Kind kind) { return kind == Kind::Q4_1 ? Q4_1_BYTES : Q8_0_BYTES; }

// Activations as int8 blocks. With `fine`, each value is x = t * (256 q + q2) with a second int8
// q2 for the residual (t = s / 256): about 16-bit activations for twice the dot products, which
// VNNI still pays for only at prefill sizes. Per block: the scale t (or s) and x's sum t * (256
// sum(q) + sum(q2)) (or s * sum(q)).
struct QuantizedRows {
  int64_t rows = 0, k = 0, nb = 0;
  bool fine = false;
  std::vector<int8_t> q, q2;  // [rows, k]
  std::vector<float> scale, sum;  // [rows, nb]
};

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Scalar block quantizer; nearbyint rounds half to even like the vector path's cvtps2dq.
template <typename T>
void quantize_block_scalar(const T* x, bool fine, int8_t* q, int8_t* q2, float* scale, float* sum) {
  float amax = 0.f;
  for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total = 0, total2 = 0;
  for (int i = 0; i < QK; ++i) {
    const float v = static_cast<float>(x[i]) * inv;
    const float r = std::nearbyint(v);
    q[i] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(r), -127, 127));
    total += q[i];
    if (fine) {
      q2[i] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(std::nearbyint((v - r) * 256.f)), -128, 127));
      total2 += q2[i];
    }
  }
  *scale = fine ? s / 256.f : s;
  *sum = fine ? *scale * static_cast<float>(256 * total + total2) : s * static_cast<float>(total);
}

#ifdef QGEMV_AVX512
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
void quantize_block(const T* x, bool fine, int8_t* q, int8_t* q2, float* scale, float* sum) {
  const __m512 a = load16(x), b = load16(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512 va = _mm512_mul_ps(a, vinv), vb = _mm512_mul_ps(b, vinv);
  const __m512i qa = _mm512_cvtps_epi32(va), qb = _mm512_cvtps_epi32(vb);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  if (!fine) {
    *scale = s;
    *sum = s * static_cast<float>(total);
    return;
  }
  const __m512 k256 = _mm512_set1_ps(256.f);
  const __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(va, _mm512_cvtepi32_ps(qa)), k256));
  const __m512i rb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(vb, _mm512_cvtepi32_ps(qb)), k256));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q2), _mm512_cvtsepi32_epi8(ra));  // saturates 128 -> 127
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + 16), _mm512_cvtsepi32_epi8(rb));
  const __m512i lim = _mm512_set1_epi32(127);
  const int32_t total2 = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_min_epi32(ra, lim), _mm512_min_epi32(rb, lim)));
  *scale = s / 256.f;
  *sum = *scale * static_cast<float>(256 * total + total2);
}
#else
template <typename T>
void quantize_block(const T* x, bool fine, int8_t* q, int8_t* q2, float* scale, float* sum) {
  quantize_block_scalar(x, fine, q, q2, scale, sum);
}
#endif

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t k, bool fine) {
  QuantizedRows out;
  out.rows = rows, out.k = k, out.nb = k / QK, out.fine = fine;
  out.q.resize(rows * k);
  if (fine) out.q2.resize(rows * k);
  out.scale.resize(rows * out.nb);
  out.sum.resize(rows * out.nb);
  const int64_t nb = out.nb;
  // Only prefill-sized inputs are worth a parallel region (~1 µs per 576-wide row on one core).
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t at = r * k + b * QK;
        quantize_block(x + at, fine, out.q.data() + at, fine ? out.q2.data() + at : nullptr, &out.scale[r * nb + b],
                       &out.sum[r * nb + b]);
      }
  });
  return out;
}

template <typename OutT>
struct Output {
  OutT* y;  // [rows, n]
  int64_t n;
};

#ifdef QGEMV_AVX512
inline void store16(float* y, __mmask16 mask, __m512 v) { _mm512_mask_storeu_ps(y, mask, v); }
inline void store16(c10::BFloat16* y, __mmask16 mask, __m512 v) {
#if defined(__AVX512BF16__)
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
#else  // round to nearest even by hand (finite values; NaN cannot come out of these products)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
  _mm256_mask_storeu_epi16(y, mask, h);
}

inline __m512i bcast4(const int8_t* p) { return _mm512_set1_epi32(load_i32(p)); }

// Integer dot products of one block for the 16 rows of a tile: w[c] are the 8 code vectors, the
// first 4 against activations 0..15 and the last 4 against 16..31 (two chains for latency).
template <bool FINE>
inline __m512i block_dot(const __m512i* w, const int8_t* x, const int8_t* x2) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    s0 = _mm512_dpbusd_epi32(s0, w[c], bcast4(x + 4 * c));
    s1 = _mm512_dpbusd_epi32(s1, w[c + 4], bcast4(x + 16 + 4 * c));
  }
  __m512i dot = _mm512_add_epi32(s0, s1);
  if constexpr (FINE) {
    __m512i f0 = _mm512_setzero_si512(), f1 = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      f0 = _mm512_dpbusd_epi32(f0, w[c], bcast4(x2 + 4 * c));
      f1 = _mm512_dpbusd_epi32(f1, w[c + 4], bcast4(x2 + 16 + 4 * c));
    }
    dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), _mm512_add_epi32(f0, f1));
  }
  return dot;
}

// One tile (16 output rows) against R activation rows starting at r0.
template <Kind K, bool FINE, int R, typename OutT>
void tile_avx512(const uint8_t* w, const QuantizedRows& xq, int64_t r0, int64_t col0, __mmask16 mask, Output<OutT> out) {
  const int64_t nb = xq.nb, k = xq.k;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, w += block_bytes(K)) {
    __m512i codes[8];
    __m512 d, m;
    if constexpr (K == Kind::Q4_1) {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(w + 64 * c);
        codes[c] = _mm512_and_si512(v, low);
        codes[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 256)));
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 288)));
    } else {
      for (int c = 0; c < 8; ++c) codes[c] = _mm512_loadu_si512(w + 64 * c);
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 512)));
    }
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * k + b * QK, i = (r0 + r) * nb + b;
      const __m512i dot = block_dot<FINE>(codes, xq.q.data() + at, FINE ? xq.q2.data() + at : nullptr);
      if constexpr (K == Kind::Q4_1) {  // d * scale * dot + m * sum
        const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xq.scale[i]));
        acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xq.sum[i]), acc[r]);
      } else {  // d * (scale * dot(u, x) - 128 * sum)
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xq.scale[i]), _mm512_set1_ps(-128.f * xq.sum[i]));
        acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) store16(out.y + (r0 + r) * out.n + col0, mask, acc[r]);
}
#endif

inline float half_to_float(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// Portable version of the same tile: reads the same layout, same arithmetic per block.
template <Kind K, typename OutT>
void tile_scalar(const uint8_t* w, const QuantizedRows& xq, int64_t r0, int rows, int64_t col0, int64_t valid,
                 Output<OutT> out) {
  const int64_t nb = xq.nb, k = xq.k;
  for (int r = 0; r < rows; ++r) {
    float acc[TILE] = {};
    const uint8_t* wb = w;
    for (int64_t b = 0; b < nb; ++b, wb += block_bytes(K)) {
      const int64_t at = (r0 + r) * k + b * QK, i = (r0 + r) * nb + b;
      const int8_t* x = xq.q.data() + at;
      const int8_t* x2 = xq.fine ? xq.q2.data() + at : nullptr;
      for (int j = 0; j < TILE; ++j) {
        int32_t dot = 0, dot2 = 0;
        for (int c = 0; c < 8; ++c)
          for (int e = 0; e < 4; ++e) {
            // Q4_1: chunk c < 4 low nibbles -> inputs 4c+e, high nibbles -> 16+4c+e.
            const int input = K == Kind::Q4_1 ? (c < 4 ? 4 * c + e : 16 + 4 * (c - 4) + e) : 4 * c + e;
            const uint8_t byte = K == Kind::Q4_1 ? wb[64 * (c % 4) + 4 * j + e] : wb[64 * c + 4 * j + e];
            const int32_t code = K == Kind::Q4_1 ? (c < 4 ? byte & 0xF : byte >> 4) : byte;
            dot += code * x[input];
            if (x2) dot2 += code * x2[input];
          }
        if (x2) dot = dot * 256 + dot2;
        if constexpr (K == Kind::Q4_1) {
          const float d = half_to_float(wb + 256 + 2 * j), m = half_to_float(wb + 288 + 2 * j);
          acc[j] += static_cast<float>(dot) * xq.scale[i] * d;
          acc[j] += m * xq.sum[i];
        } else {
          const float d = half_to_float(wb + 512 + 2 * j);
          acc[j] += (static_cast<float>(dot) * xq.scale[i] - 128.f * xq.sum[i]) * d;
        }
      }
    }
    for (int64_t j = 0; j < valid; ++j) out.y[(r0 + r) * out.n + col0 + j] = static_cast<OutT>(acc[j]);
  }
}

template <Kind K, bool FINE, typename OutT>
void run_tiles(const uint8_t* packed, const QuantizedRows& xq, int64_t n, int64_t begin, int64_t end, int64_t r_begin,
               int64_t r_end, Output<OutT> out) {
  const int64_t tile_bytes = xq.nb * block_bytes(K);
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* w = packed + t * tile_bytes;
    const int64_t col0 = t * TILE, valid = std::min(TILE, n - col0);
    for (int64_t r0 = r_begin; r0 < r_end; r0 += ROWS) {
      const int rows = static_cast<int>(std::min<int64_t>(ROWS, r_end - r0));
#ifdef QGEMV_AVX512
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
      static_assert(ROWS == 4, "the switch below covers 1..ROWS rows");
      switch (rows) {
        case 4: tile_avx512<K, FINE, 4>(w, xq, r0, col0, mask, out); break;
        case 3: tile_avx512<K, FINE, 3>(w, xq, r0, col0, mask, out); break;
        case 2: tile_avx512<K, FINE, 2>(w, xq, r0, col0, mask, out); break;
        default: tile_avx512<K, FINE, 1>(w, xq, r0, col0, mask, out); break;
      }
#else
      tile_scalar<K>(w, xq, r0, rows, col0, valid, out);
#endif
    }
  }
}

template <Kind K, typename T>
void gemv_typed(const T* x, int64_t rows, int64_t k, const uint8_t* packed, int64_t n, T* y, bool fine) {
  const QuantizedRows xq = quantize_rows(x, rows, k, fine);
  const int64_t tiles = (n + TILE - 1) / TILE;
  Output<T> out{y, n};
  // Grain: at least ~64 KiB of weights per task so the fork/join (~2 µs) stays small against it.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, xq.nb * block_bytes(K)));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; r += ROW_CHUNK) {
      const int64_t r_end = std::min(rows, r + ROW_CHUNK);
      if (fine) run_tiles<K, true>(packed, xq, n, begin, end, r, r_end, out);
      else run_tiles<K, false>(packed, xq, n, begin, end, r, r_end, out);
    }
  });
}

torch::Tensor gemv(Kind kind, const torch::Tensor& x_in, const torch::Tensor& packed, int64_t n, int64_t activation_bits) {
  RECORD_FUNCTION(kind == Kind::Q4_1 ? "native::quant_gemv_q4_1" : "native::quant_gemv_q8_0", c10::ArrayRef<const c10::IValue>{});
  TORCH_CHECK(x_in.device().is_cpu() && packed.device().is_cpu(), "quant_gemv: CPU tensors only");
  TORCH_CHECK(x_in.dim() >= 1, "quant_gemv: x must be [..., in_features]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16, "quant_gemv: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "quant_gemv: packed weights must be contiguous uint8");
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16, "quant_gemv: activation_bits must be 8 or 16");
  const torch::Tensor x = x_in.contiguous();
  const int64_t k = x.size(-1);
  TORCH_CHECK(k % QK == 0 && k > 0, "quant_gemv: in_features must be a positive multiple of 32, got ", k);
  const int64_t rows = x.numel() / k;
  const int64_t tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(n > 0 && packed.numel() == tiles * (k / QK) * block_bytes(kind),
              "quant_gemv: packed weights do not match out_features=", n, " x in_features=", k);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  torch::Tensor y = torch::empty(shape, x.options());
  if (rows == 0) return y;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const bool fine = activation_bits == 16;
  if (x.scalar_type() == at::kFloat) {
    if (kind == Kind::Q4_1) gemv_typed<Kind::Q4_1>(x.data_ptr<float>(), rows, k, w, n, y.data_ptr<float>(), fine);
    else gemv_typed<Kind::Q8_0>(x.data_ptr<float>(), rows, k, w, n, y.data_ptr<float>(), fine);
  } else {
    auto* xb = reinterpret_cast<const c10::BFloat16*>(x.data_ptr<at::BFloat16>());
    auto* yb = reinterpret_cast<c10::BFloat16*>(y.data_ptr<at::BFloat16>());
    if (kind == Kind::Q4_1) gemv_typed<Kind::Q4_1>(xb, rows, k, w, n, yb, fine);
    else gemv_typed<Kind::Q8_0>(xb, rows, k, w, n, yb, fine);
  }
  return y;
}

// -- packing ------------------------------------------------------------------------------------
void check_pack_inputs(const torch::Tensor& codes, const torch::Tensor& scales, at::ScalarType code_type) {
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu(), "quant_pack: CPU tensors only");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == code_type, "quant_pack: codes must be 2-D ", code_type);
  TORCH_CHECK(codes.size(1) % QK == 0 && codes.size(1) > 0, "quant_pack: in_features must be a positive multiple of 32");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) / QK,
              "quant_pack: scales must be [out_features, in_features / 32]");
}

inline void put_half(uint8_t* p, float v) {
  const c10::Half h(v);
  std::memcpy(p, &h, 2);
}

// Lays n rows of k / 32 blocks out as TILE-row tiles of `block_bytes` per block: fill(blk, j, row, b)
// writes row `row`'s block b as member j of its tile; rows past n stay zero.
template <typename Fill>
torch::Tensor pack_tiles(int64_t n, int64_t k, int64_t block_bytes, Fill fill) {
  const int64_t nb = k / QK, tiles = (n + TILE - 1) / TILE;
  torch::Tensor out = torch::zeros({tiles * nb * block_bytes}, torch::dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t j = 0; j < TILE && t * TILE + j < n; ++j) fill(o + (t * nb + b) * block_bytes, j, t * TILE + j, b);
  });
  return out;
}

// codes uint8 [n, k] (0..15), scales d and mins m float [n, k/32] -> Q4_1 tiles.
torch::Tensor pack_q4_1(const torch::Tensor& codes_in, const torch::Tensor& scales_in, const torch::Tensor& mins_in) {
  check_pack_inputs(codes_in, scales_in, at::kByte);
  TORCH_CHECK(mins_in.sizes() == scales_in.sizes(), "quant_pack_q4_1: mins must have the shape of scales");
  const torch::Tensor codes = codes_in.contiguous();
  const torch::Tensor scales = scales_in.to(at::kFloat).contiguous(), mins = mins_in.to(at::kFloat).contiguous();
  const int64_t n = codes.size(0), k = codes.size(1), nb = k / QK;
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float *d = scales.data_ptr<float>(), *m = mins.data_ptr<float>();
  return pack_tiles(n, k, Q4_1_BYTES, [&](uint8_t* blk, int64_t j, int64_t row, int64_t b) {
    const uint8_t* src = c + row * k + b * QK;
    for (int cc = 0; cc < 4; ++cc)
      for (int e = 0; e < 4; ++e)
        blk[64 * cc + 4 * j + e] = (src[4 * cc + e] & 0xF) | ((src[16 + 4 * cc + e] & 0xF) << 4);
    put_half(blk + 256 + 2 * j, d[row * nb + b]);
    put_half(blk + 288 + 2 * j, m[row * nb + b]);
  });
}

// codes int8 [n, k], scales d float [n, k/32] -> Q8_0 tiles (codes stored as q + 128).
torch::Tensor pack_q8_0(const torch::Tensor& codes_in, const torch::Tensor& scales_in) {
  check_pack_inputs(codes_in, scales_in, at::kChar);
  const torch::Tensor codes = codes_in.contiguous(), scales = scales_in.to(at::kFloat).contiguous();
  const int64_t n = codes.size(0), k = codes.size(1), nb = k / QK;
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* d = scales.data_ptr<float>();
  return pack_tiles(n, k, Q8_0_BYTES, [&](uint8_t* blk, int64_t j, int64_t row, int64_t b) {
    const int8_t* src = c + row * k + b * QK;
    for (int cc = 0; cc < 8; ++cc)
      for (int e = 0; e < 4; ++e) blk[64 * cc + 4 * j + e] = static_cast<uint8_t>(src[4 * cc + e] + 128);
    put_half(blk + 512 + 2 * j, d[row * nb + b]);
  });
}

const char* isa() {
#ifdef QGEMV_AVX512
  return "avx512_vnni";
#else
  return "scalar";
#endif
}

}  // namespace

torch::Tensor quant_gemv_q4_1(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features, int64_t activation_bits) {
  return gemv(Kind::Q4_1, x, packed, out_features, activation_bits);
}

void register_quant_gemv(pybind11::module_& m) {
  m.def("quant_pack_q4_1", &pack_q4_1, "codes uint8 [N,K] (0..15), scales, mins float [N,K/32] -> packed Q4_1 tiles",
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("mins"));
  m.def("quant_pack_q8_0", &pack_q8_0, "codes int8 [N,K], scales float [N,K/32] -> packed Q8_0 tiles",
        pybind11::arg("codes"), pybind11::arg("scales"));
  m.def(
      "quant_gemv_q4_1",
      &quant_gemv_q4_1,
      "x [..., K] float32/bfloat16 @ packed Q4_1 weights^T -> [..., out_features] in x's dtype; activations rounded "
      "per 32-block to int8 (activation_bits=8, llama.cpp's Q8_1) or to two int8 parts (16)",
      pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("activation_bits") = 16, ReleaseGil());
  m.def(
      "quant_gemv_q8_0",
      [](const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features, int64_t activation_bits) {
        return gemv(Kind::Q8_0, x, packed, out_features, activation_bits);
      },
      "x [..., K] float32/bfloat16 @ packed Q8_0 weights^T -> [..., out_features] in x's dtype (activation_bits as above)",
      pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("out_features"), pybind11::arg("activation_bits") = 16, ReleaseGil());
  m.def("quant_gemv_isa", &isa, "instruction set the quantized kernels were built for: avx512_vnni or scalar");
}
