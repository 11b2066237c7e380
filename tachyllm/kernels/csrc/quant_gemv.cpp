// Quantized matrix-vector products over GGUF's block formats, kept in the file's own codes and scales:
// Q4_0, Q4_1, Q5_0, Q8_0 (32-weight blocks) and the K-quants Q4_K, Q5_K, Q6_K (256-weight super-blocks
// of 32-weight sub-blocks with 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K, per 16 weights) scales). Activations
// are quantized per 32-block to int8 (llama.cpp's Q8_1: s = max|x| / 127, plus s * sum(q) per block),
// so every 32 weights are one integer dot product; or, with activation_bits=16, to two int8 parts (the
// residual in units of s/256), two dot products. Each activation row is rounded and accumulated on
// its own, in a fixed order (blocks in input order): a row's result does not depend on the other rows
// of the batch nor on the number of threads.
//
// Without AVX-512 VNNI, an AVX2 path (e.g. AMD Zen 3) multiplies the same tiles as two 8-row halves
// with the same arithmetic (see tile_avx2). Portable scalar code reads the same layout where neither
// exists (correct, not fast: the Python side then prefers aten's int4 kernel or the dequantized
// weights, see quantization/).
//
// Packed layout ("tiles"): 16 output rows are interleaved so that int32 lane j of an AVX-512 register
// accumulates row j. A tile holds, per super-block (one 32-block for the non-K formats), the codes of
// each 32-weight sub-block and the super-block's scales for the 16 rows (K-quants: scales first):
//   codes per sub-block: 4-bit formats 4 x 64 bytes of nibbles; Q5_0 / Q5_K the same + 64 bytes of
//     5th bits; Q6_K the same + 2 x 64 bytes of 5th/6th bit pairs; Q8_0 8 x 64 bytes (u = q + 128).
//   scales: Q4_0 / Q5_0 / Q8_0 16 fp16 d; Q4_1 16 fp16 d, 16 fp16 m; Q4_K / Q5_K 16 fp32 d,
//     16 fp32 dmin, 8 x 16 uint8 sub-block scales, 8 x 16 uint8 sub-block mins; Q6_K 16 fp32 d,
//     16 x 16 int8 scales (one per 16 weights).
// Code vector c (0..7) of a sub-block holds, in byte 4j+i, row j's weight 4c+i: the nibble vectors
// are chunk c's low nibbles (c < 4) or chunk c-4's high nibbles; bit c of the Q5 plane's byte 4j+i is
// that weight's 5th bit; bits 2(c%4), 2(c%4)+1 of Q6 plane c/4 its 5th and 6th. One VPDPBUSD (u8
// weights x s8 activations) then adds 4 products for each of the 16 rows, with the 4 activations
// broadcast to every lane: no horizontal sums, and the per-row scales load as one vector. The tiles of
// a matrix follow each other in row order, super-blocks in input order: each thread streams one
// contiguous range.
//
// Arithmetic per 32-block of a row (s, sum: the activations' scale and sum; dot: the integer dot
// product of the stored unsigned codes u):
//   Q4_1:  d*s*dot + m*sum
//   Q4_0 / Q5_0 / Q8_0 (w = d*(u - o), o = 8 / 16 / 128): d*(s*dot - o*sum)
//   Q4_K / Q5_K (w = d*sc*u - dmin*mn): (d*sc)*s*dot - (dmin*mn)*sum; d*sc and dmin*mn are exact in
//     fp32 (an fp16 times a 6-bit integer), so this is Q4_1's formula on the file's exact block values
//   Q6_K (w = d*sc*(u - 32), one sc per 16 weights): per half, (d*sc)*s*(dot_half - 32*xsum_half), the
//     integer activation sum of each 16-half kept beside the block's.
// Rows past the matrix's end (out_features not a multiple of 16) are zero and never stored.
//
// One call can multiply several matrices stacked along the output (a fused q/k/v projection whose
// parts the file stores in different formats): the activations are rounded once, every part's tiles
// are split over the threads together, and each part writes its own output columns.
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QGEMV_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QGEMV_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;    // weights per (sub-)block, and per block of rounded activations
constexpr int64_t TILE = 16;  // output rows per tile: one 32-bit lane each
// Activation rows sharing one decoded weight block (accumulators held in registers).
constexpr int ROWS = 4;
// Activation rows per pass over a thread's tiles: their int8 copy stays in L1/L2 while the weights
// stream; only prefill-sized inputs take more than one pass.
constexpr int64_t ROW_CHUNK = 64;
// How far ahead of the sub-block being multiplied its thread prefetches the tiles (they follow each
// other in memory). The hardware prefetcher alone fell behind as soon as a block took more work than
// one 8-bit row: a 5-row verification of a Q4_K_M model then ran at half the weight stream's speed.
constexpr int64_t PREFETCH_BYTES = 8192;
// Only products of at most this many rows prefetch (decodes, verifications): larger ones reread each
// tile from cache pass after pass and are compute bound, and prefetching made them slower.
constexpr int64_t PREFETCH_MAX_ROWS = 2 * ROWS;

// Tile formats, numbered as GGML's block types (the layout tensors from Python hold these ids).
enum class Format : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
constexpr Format kFormats[] = {Format::Q4_0, Format::Q4_1, Format::Q5_0, Format::Q8_0,
                               Format::Q4_K, Format::Q5_K, Format::Q6_K};

constexpr bool is_k(Format f) { return f == Format::Q4_K || f == Format::Q5_K || f == Format::Q6_K; }
// Rows per pass of format F. With AVX-512's 32 vector registers a Q4_K tile holds 6 rows'
// accumulators beside its codes: a 5-token verification in one pass instead of 3 + 2 rows. Q6_K's
// tile, with its two scale vectors and half sums, ran 45-50% slower at 5 or 6 rows than in two
// passes (on an AVX-512 host, before the tiles were noinline; not measured since); the other
// formats were not measured at more than ROWS.
constexpr int max_rows(Format f) {
#ifdef QGEMV_AVX512
  return f == Format::Q4_K ? 6 : ROWS;
#else
  static_cast<void>(f);
  return ROWS;
#endif
}
constexpr bool has_q5_plane(Format f) { return f == Format::Q5_0 || f == Format::Q5_K; }
constexpr int64_t sub_blocks(Format f) { return is_k(f) ? 8 : 1; }  // 32-blocks per super-block
constexpr int64_t super_weights(Format f) { return sub_blocks(f) * QK; }
// Tile bytes of one sub-block's codes (16 rows x 32 weights).
constexpr int64_t code_bytes(Format f) {
  return f == Format::Q8_0 ? 512 : f == Format::Q6_K ? 384 : has_q5_plane(f) ? 320 : 256;
}
// Tile bytes of one super-block's scales (16 rows). K-quants keep d (and dmin) as fp32, converted
// from the file's fp16 at load (exact): their d is often an fp16 subnormal (Q6_K's d ~ max|w| / 4064),
// and converting those in the kernel (VCVTPH2PS) takes a microcode assist: real Q6_K matrices ran at
// a quarter of the speed of random ones.
constexpr int64_t scale_bytes(Format f) {
  return f == Format::Q4_1 ? 64 : f == Format::Q6_K ? 64 + 256 : is_k(f) ? 128 + 256 : 32;
}
// Within a K-quant's scales: fp32 d at 0, fp32 dmin at 64, then the sub-block scales (and mins).
constexpr int64_t sub_scales_at(Format f) { return f == Format::Q6_K ? 64 : 128; }
constexpr int64_t SUB_MINS_AT = 256;
constexpr int64_t chunk_bytes(Format f) { return sub_blocks(f) * code_bytes(f) + scale_bytes(f); }
// Where a chunk's scales and codes start. A K-quant super-block's scales come first: the kernel
// needs them for its first sub-block, and at the end of a 2-3 KiB chunk they would not have been
// prefetched yet (a demand miss per super-block: 2x the time of a one-row product). A 32-block's
// scales share its last cache lines, so they follow the codes.
constexpr int64_t scales_at(Format f) { return is_k(f) ? 0 : code_bytes(f); }
constexpr int64_t codes_at(Format f) { return is_k(f) ? scale_bytes(f) : 0; }

// Prefetches, PREFETCH_BYTES ahead, the cache lines of sub-block j's codes (and with j = 0 the
// super-block's scales) of the chunk at w. Prefetches never fault, so reading past a matrix is harmless.
template <Format F>
inline void prefetch_ahead(const uint8_t* w, int64_t j) {
  const uint8_t* ahead = w + PREFETCH_BYTES;
  for (int64_t line = 0; line < code_bytes(F); line += 64)
    __builtin_prefetch(ahead + codes_at(F) + j * code_bytes(F) + line, 0, 3);
  if (j == 0)
    for (int64_t line = 0; line < scale_bytes(F); line += 64) __builtin_prefetch(ahead + scales_at(F) + line, 0, 3);
}

// The code offset o of w = d * (u - o) formats (0: a format with its own min).
constexpr int code_offset(Format f) {
  return f == Format::Q4_0 ? 8 : f == Format::Q5_0 ? 16 : f == Format::Q8_0 ? 128 : f == Format::Q6_K ? 32 : 0;
}
// Bytes of one block in a GGUF file, and its weights.
constexpr int64_t file_block_bytes(Format f) {
  switch (f) {
    case Format::Q4_0: return 18;
    case Format::Q4_1: return 20;
    case Format::Q5_0: return 22;
    case Format::Q8_0: return 34;
    case Format::Q4_K: return 144;
    case Format::Q5_K: return 176;
    case Format::Q6_K: return 210;
  }
  return 0;
}

bool known_format(int64_t id) {
  return std::any_of(std::begin(kFormats), std::end(kFormats), [&](Format f) { return static_cast<int64_t>(f) == id; });
}

// Calls fn(std::integral_constant<Format, f>) for the runtime format f.
template <typename Fn>
void with_format(Format f, Fn&& fn) {
  switch (f) {
    case Format::Q4_0: fn(std::integral_constant<Format, Format::Q4_0>{}); break;
    case Format::Q4_1: fn(std::integral_constant<Format, Format::Q4_1>{}); break;
    case Format::Q5_0: fn(std::integral_constant<Format, Format::Q5_0>{}); break;
    case Format::Q8_0: fn(std::integral_constant<Format, Format::Q8_0>{}); break;
    case Format::Q4_K: fn(std::integral_constant<Format, Format::Q4_K>{}); break;
    case Format::Q5_K: fn(std::integral_constant<Format, Format::Q5_K>{}); break;
    case Format::Q6_K: fn(std::integral_constant<Format, Format::Q6_K>{}); break;
  }
}

// One matrix of a (possibly stacked) packed weight.
struct Part {
  Format format;
  int64_t n;      // output rows
  int64_t col0;   // first output column
  int64_t tile0;  // first tile among all parts' tiles
  int64_t tiles;
  const uint8_t* w;  // its first tile
  int64_t tile_bytes;
};

// Activations as int8 blocks. With `fine`, each value is x = t * (256 q + q2) with a second int8
// q2 for the residual (t = s / 256): about 16-bit activations for twice the dot products, which
// VNNI still pays for only at prefill sizes. Per block: the scale t (or s), x's sum t * (256
// sum(q) + sum(q2)) (or s * sum(q)), and the integer sums 256 sum(q) + sum(q2) (or sum(q)) of each
// 16-half (Q6_K's scales change every 16 weights).
struct QuantizedRows {
  int64_t rows = 0, k = 0, nb = 0;
  bool fine = false;
  std::vector<int8_t> q, q2;      // [rows, k]
  std::vector<float> scale, sum;  // [rows, nb]
  std::vector<int32_t> half_sum;  // [rows, nb, 2]
};

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Scalar block quantizer; nearbyint rounds half to even like the vector path's cvtps2dq.
template <typename T>
void quantize_block_scalar(const T* x, bool fine, int8_t* q, int8_t* q2, float* scale, float* sum, int32_t* half) {
  float amax = 0.f;
  for (int i = 0; i < QK; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t total[2] = {0, 0}, total2[2] = {0, 0};
  for (int i = 0; i < QK; ++i) {
    const float v = static_cast<float>(x[i]) * inv;
    const float r = std::nearbyint(v);
    q[i] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(r), -127, 127));
    total[i / 16] += q[i];
    if (fine) {
      q2[i] = static_cast<int8_t>(std::clamp(static_cast<int32_t>(std::nearbyint((v - r) * 256.f)), -128, 127));
      total2[i / 16] += q2[i];
    }
  }
  for (int h = 0; h < 2; ++h) half[h] = fine ? 256 * total[h] + total2[h] : total[h];
  *scale = fine ? s / 256.f : s;
  *sum = *scale * static_cast<float>(half[0] + half[1]);
}

#ifdef QGEMV_AVX512
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

template <typename T>
void quantize_block(const T* x, bool fine, int8_t* q, int8_t* q2, float* scale, float* sum, int32_t* half) {
  const __m512 a = load16(x), b = load16(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m512 va = _mm512_mul_ps(a, vinv), vb = _mm512_mul_ps(b, vinv);
  const __m512i qa = _mm512_cvtps_epi32(va), qb = _mm512_cvtps_epi32(vb);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  half[0] = _mm512_reduce_add_epi32(qa);
  half[1] = _mm512_reduce_add_epi32(qb);
  if (fine) {
    const __m512 k256 = _mm512_set1_ps(256.f);
    const __m512i ra = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(va, _mm512_cvtepi32_ps(qa)), k256));
    const __m512i rb = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(vb, _mm512_cvtepi32_ps(qb)), k256));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q2), _mm512_cvtsepi32_epi8(ra));  // saturates 128 -> 127
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + 16), _mm512_cvtsepi32_epi8(rb));
    const __m512i lim = _mm512_set1_epi32(127);
    half[0] = 256 * half[0] + _mm512_reduce_add_epi32(_mm512_min_epi32(ra, lim));
    half[1] = 256 * half[1] + _mm512_reduce_add_epi32(_mm512_min_epi32(rb, lim));
  }
  *scale = fine ? s / 256.f : s;
  *sum = *scale * static_cast<float>(half[0] + half[1]);
}
#elif defined(QGEMV_AVX2)
inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8(const c10::BFloat16* x) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}
// 4 x 8 int32 (already within int8's range) -> 32 int8 in input order.
inline void store_i8x32(int8_t* q, const __m256i v[4]) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  // The packs interleave 128-bit lanes: 32-bit groups come out as 0 2 4 6 1 3 5 7.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// The same rounding as quantize_block_scalar, 8 lanes at a time (cvtps2dq rounds half to even).
template <typename T>
void quantize_block(const T* x, bool fine, int8_t* q, int8_t* q2, float* scale, float* sum, int32_t* half) {
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) v[i] = load8(x + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = std::max(_mm_cvtss_f32(m4), _mm_cvtss_f32(_mm_movehdup_ps(m4)));
  const float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i qi[4], ri[4];
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_mul_ps(v[i], vinv);
    qi[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(v[i]), lo), hi);
  }
  store_i8x32(q, qi);
  half[0] = sum8(_mm256_add_epi32(qi[0], qi[1]));
  half[1] = sum8(_mm256_add_epi32(qi[2], qi[3]));
  if (fine) {
    const __m256 k256 = _mm256_set1_ps(256.f);
    const __m256i lo2 = _mm256_set1_epi32(-128);
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_sub_ps(v[i], _mm256_cvtepi32_ps(qi[i]));
      ri[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(r, k256)), lo2), hi);
    }
    store_i8x32(q2, ri);
    half[0] = 256 * half[0] + sum8(_mm256_add_epi32(ri[0], ri[1]));
    half[1] = 256 * half[1] + sum8(_mm256_add_epi32(ri[2], ri[3]));
  }
  *scale = fine ? s / 256.f : s;
  *sum = *scale * static_cast<float>(half[0] + half[1]);
}
#else
template <typename T>
void quantize_block(const T* x, bool fine, int8_t* q, int8_t* q2, float* scale, float* sum, int32_t* half) {
  quantize_block_scalar(x, fine, q, q2, scale, sum, half);
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
  out.half_sum.resize(2 * rows * out.nb);
  const int64_t nb = out.nb;
  // Only prefill-sized inputs are worth a parallel region (~1 µs per 576-wide row on one core).
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t at = r * k + b * QK, i = r * nb + b;
        quantize_block(x + at, fine, out.q.data() + at, fine ? out.q2.data() + at : nullptr, &out.scale[i], &out.sum[i],
                       &out.half_sum[2 * i]);
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

// acc += the 16 rows' codes w . the 4 activations at x (the same 4 for every row): one VPDPBUSD that
// reads x as an embedded broadcast. GCC has no pattern for that form and put a VPBROADCASTD before
// every product instead, as many instructions again as the products themselves.
inline __m512i dot4(__m512i acc, __m512i w, const int8_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int8_t (*)[4]>(x)));
  return acc;
}
inline __m512 half16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// Moves bit `from` of every byte to bit `to` (the bits in `mask`); 16-bit shifts by at most 4 keep
// the selected bits inside their byte.
template <int FROM, int TO>
inline __m512i move_bits(__m512i v, __m512i mask) {
  if constexpr (TO > FROM)
    return _mm512_and_si512(_mm512_slli_epi16(v, TO - FROM), mask);
  else if constexpr (TO < FROM)
    return _mm512_and_si512(_mm512_srli_epi16(v, FROM - TO), mask);
  else
    return _mm512_and_si512(v, mask);
}

// The 8 code vectors of one sub-block (16 rows x 32 weights) as unsigned bytes.
template <Format F>
inline void load_codes(const uint8_t* c, __m512i codes[8]) {
  if constexpr (F == Format::Q8_0) {
    for (int i = 0; i < 8; ++i) codes[i] = _mm512_loadu_si512(c + 64 * i);
    return;
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int i = 0; i < 4; ++i) {
    const __m512i v = _mm512_loadu_si512(c + 64 * i);
    codes[i] = _mm512_and_si512(v, low);
    codes[i + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
  if constexpr (has_q5_plane(F)) {
    const __m512i h = _mm512_loadu_si512(c + 256), bit = _mm512_set1_epi8(0x10);
    codes[0] = _mm512_or_si512(codes[0], move_bits<0, 4>(h, bit));
    codes[1] = _mm512_or_si512(codes[1], move_bits<1, 4>(h, bit));
    codes[2] = _mm512_or_si512(codes[2], move_bits<2, 4>(h, bit));
    codes[3] = _mm512_or_si512(codes[3], move_bits<3, 4>(h, bit));
    codes[4] = _mm512_or_si512(codes[4], move_bits<4, 4>(h, bit));
    codes[5] = _mm512_or_si512(codes[5], move_bits<5, 4>(h, bit));
    codes[6] = _mm512_or_si512(codes[6], move_bits<6, 4>(h, bit));
    codes[7] = _mm512_or_si512(codes[7], move_bits<7, 4>(h, bit));
  } else if constexpr (F == Format::Q6_K) {
    const __m512i two = _mm512_set1_epi8(0x30);
    for (int p = 0; p < 2; ++p) {
      const __m512i h = _mm512_loadu_si512(c + 256 + 64 * p);
      codes[4 * p] = _mm512_or_si512(codes[4 * p], move_bits<0, 4>(h, two));
      codes[4 * p + 1] = _mm512_or_si512(codes[4 * p + 1], move_bits<2, 4>(h, two));
      codes[4 * p + 2] = _mm512_or_si512(codes[4 * p + 2], move_bits<4, 4>(h, two));
      codes[4 * p + 3] = _mm512_or_si512(codes[4 * p + 3], move_bits<6, 4>(h, two));
    }
  }
}

// Integer dot products of one block for the 16 rows of a tile, per 16-half of its inputs: w[0..3]
// against activations 0..15 (lo), w[4..7] against 16..31 (hi).
template <bool FINE>
inline void block_dot(const __m512i* w, const int8_t* x, const int8_t* x2, __m512i& lo, __m512i& hi) {
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    s0 = dot4(s0, w[c], x + 4 * c);
    s1 = dot4(s1, w[c + 4], x + 16 + 4 * c);
  }
  if constexpr (FINE) {
    __m512i f0 = _mm512_setzero_si512(), f1 = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      f0 = dot4(f0, w[c], x2 + 4 * c);
      f1 = dot4(f1, w[c + 4], x2 + 16 + 4 * c);
    }
    s0 = _mm512_add_epi32(_mm512_slli_epi32(s0, 8), f0);
    s1 = _mm512_add_epi32(_mm512_slli_epi32(s1, 8), f1);
  }
  lo = s0, hi = s1;
}

// One tile (16 output rows) against R activation rows starting at r0.
// PREFETCH is a template parameter, not a runtime flag: with the flag, the compiler laid out the
// loop of the products that do not prefetch worse (Q6_K at 64 rows took 1.6x the time).
// Never inlined (here and in tile_avx2): each instantiation gets registers of its own. Inlined, as
// GCC chose to do for some of them depending on how many there were, the 16-bit Q6_K tiles ran
// 1.4-1.5x slower (measured on an AVX-512 host).
template <Format F, bool FINE, bool PREFETCH, int R, typename OutT>
__attribute__((noinline)) void tile_avx512(const uint8_t* w, const QuantizedRows& xq, int64_t r0, int64_t col0,
                                           __mmask16 mask, Output<OutT> out) {
  constexpr int64_t SUB = sub_blocks(F);
  const int64_t nb = xq.nb, k = xq.k;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += SUB, w += chunk_bytes(F)) {
    const uint8_t* scales = w + scales_at(F);
    const __m512 d = is_k(F) ? _mm512_loadu_ps(scales) : half16(scales);
    __m512 m2 = _mm512_setzero_ps();  // Q4_1: m; Q4_K / Q5_K: dmin
    if constexpr (F == Format::Q4_1) m2 = half16(scales + 32);
    if constexpr (F == Format::Q4_K || F == Format::Q5_K) m2 = _mm512_loadu_ps(scales + 64);
    for (int64_t j = 0; j < SUB; ++j) {
      if constexpr (PREFETCH) prefetch_ahead<F>(w, j);
      __m512i codes[8];
      load_codes<F>(w + codes_at(F) + j * code_bytes(F), codes);
      __m512 dj = d, mj = m2, dj2 = d;
      if constexpr (F == Format::Q4_K || F == Format::Q5_K) {
        dj = _mm512_mul_ps(d, u8x16(scales + sub_scales_at(F) + 16 * j));
        mj = _mm512_mul_ps(m2, u8x16(scales + SUB_MINS_AT + 16 * j));
      } else if constexpr (F == Format::Q6_K) {
        dj = _mm512_mul_ps(d, i8x16(scales + sub_scales_at(F) + 32 * j));
        dj2 = _mm512_mul_ps(d, i8x16(scales + sub_scales_at(F) + 16 + 32 * j));
      }
      for (int r = 0; r < R; ++r) {
        const int64_t b = b0 + j, at = (r0 + r) * k + b * QK, i = (r0 + r) * nb + b;
        __m512i lo, hi;
        block_dot<FINE>(codes, xq.q.data() + at, FINE ? xq.q2.data() + at : nullptr, lo, hi);
        const __m512 s = _mm512_set1_ps(xq.scale[i]);
        if constexpr (F == Format::Q6_K) {  // per half: (d*sc) * s * (dot - 32 * half_sum)
          const int32_t* half = &xq.half_sum[2 * i];
          const __m512i a = _mm512_sub_epi32(lo, _mm512_set1_epi32(code_offset(F) * half[0]));
          const __m512i c = _mm512_sub_epi32(hi, _mm512_set1_epi32(code_offset(F) * half[1]));
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a), s), dj, acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(c), s), dj2, acc[r]);
        } else if constexpr (code_offset(F) != 0) {  // d * (s * dot - o * sum)
          const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), s,
                                           _mm512_set1_ps(-static_cast<float>(code_offset(F)) * xq.sum[i]));
          acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
        } else {  // (d*sc) * s * dot + m * sum; K-quants subtract (dmin*mn) * sum
          const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), s);
          acc[r] = _mm512_fmadd_ps(t, dj, acc[r]);
          if constexpr (F == Format::Q4_1)
            acc[r] = _mm512_fmadd_ps(mj, _mm512_set1_ps(xq.sum[i]), acc[r]);
          else
            acc[r] = _mm512_fnmadd_ps(mj, _mm512_set1_ps(xq.sum[i]), acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) store16(out.y + (r0 + r) * out.n + col0, mask, acc[r]);
}
#endif

#ifdef QGEMV_AVX2
// AVX2 without VNNI (e.g. AMD Zen 3): the same tiles, as two 8-row halves (bytes 32h..32h+31 of each
// 64-byte code vector are rows 8h..8h+7), and VPDPBUSD as VPMADDUBSW (u8 x s8 pairs to int16) then
// VPMADDWD by ones (int16 pairs to int32). Products of several code vectors are summed in int16 first
// where they cannot overflow (|x| <= 128: 4 vectors of 4- or 5-bit codes, 2 of 6-bit); Q8_0's 8-bit
// codes would overflow even one VPMADDUBSW, so they are multiplied as two nibbles (16 hi + lo). The
// integer dot products are exact and the float steps are the AVX-512 path's, in its order: the same
// bits on either instruction set.
inline __m256i bcast4_256(const int8_t* p) { return _mm256_set1_epi32(load_i32(p)); }
inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m128i load8_bytes(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm_cvtsi64_si128(v);
}
inline __m256 u8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8_bytes(p))); }
inline __m256 i8x8(const uint8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8_bytes(p))); }

template <int FROM, int TO>
inline __m256i move_bits8(__m256i v, __m256i mask) {
  if constexpr (TO > FROM)
    return _mm256_and_si256(_mm256_slli_epi16(v, TO - FROM), mask);
  else if constexpr (TO < FROM)
    return _mm256_and_si256(_mm256_srli_epi16(v, FROM - TO), mask);
  else
    return _mm256_and_si256(v, mask);
}

// Half h of the 8 code vectors of one sub-block; Q8_0: 16 vectors, low nibbles then high nibbles.
template <Format F>
constexpr int code_vectors() {
  return F == Format::Q8_0 ? 16 : 8;
}

template <Format F>
inline void load_codes_half(const uint8_t* c, int h, __m256i codes[code_vectors<F>()]) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  auto at = [&](int64_t offset) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + offset + 32 * h)); };
  if constexpr (F == Format::Q8_0) {
    for (int i = 0; i < 8; ++i) {
      const __m256i v = at(64 * i);
      codes[i] = _mm256_and_si256(v, low);
      codes[i + 8] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    return;
  }
  for (int i = 0; i < 4; ++i) {
    const __m256i v = at(64 * i);
    codes[i] = _mm256_and_si256(v, low);
    codes[i + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  }
  if constexpr (has_q5_plane(F)) {
    const __m256i p = at(256), bit = _mm256_set1_epi8(0x10);
    codes[0] = _mm256_or_si256(codes[0], move_bits8<0, 4>(p, bit));
    codes[1] = _mm256_or_si256(codes[1], move_bits8<1, 4>(p, bit));
    codes[2] = _mm256_or_si256(codes[2], move_bits8<2, 4>(p, bit));
    codes[3] = _mm256_or_si256(codes[3], move_bits8<3, 4>(p, bit));
    codes[4] = _mm256_or_si256(codes[4], move_bits8<4, 4>(p, bit));
    codes[5] = _mm256_or_si256(codes[5], move_bits8<5, 4>(p, bit));
    codes[6] = _mm256_or_si256(codes[6], move_bits8<6, 4>(p, bit));
    codes[7] = _mm256_or_si256(codes[7], move_bits8<7, 4>(p, bit));
  } else if constexpr (F == Format::Q6_K) {
    const __m256i two = _mm256_set1_epi8(0x30);
    for (int q = 0; q < 2; ++q) {
      const __m256i p = at(256 + 64 * q);
      codes[4 * q] = _mm256_or_si256(codes[4 * q], move_bits8<0, 4>(p, two));
      codes[4 * q + 1] = _mm256_or_si256(codes[4 * q + 1], move_bits8<2, 4>(p, two));
      codes[4 * q + 2] = _mm256_or_si256(codes[4 * q + 2], move_bits8<4, 4>(p, two));
      codes[4 * q + 3] = _mm256_or_si256(codes[4 * q + 3], move_bits8<6, 4>(p, two));
    }
  }
}

// Sum over code vectors w[0..3] (inputs x[0..15]) as int32 lanes, 4 products per vector and lane.
// GROUP vectors' VPMADDUBSW results are added in int16 before widening (2 * 63 * 128 * 2 < 2^15).
template <int GROUP>
inline __m256i dot16(const __m256i* w, const int8_t* x) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i total = _mm256_setzero_si256();
  for (int g = 0; g < 4; g += GROUP) {
    __m256i s = _mm256_maddubs_epi16(w[g], bcast4_256(x + 4 * g));
    for (int c = 1; c < GROUP; ++c)
      s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[g + c], bcast4_256(x + 4 * (g + c))));
    total = _mm256_add_epi32(total, _mm256_madd_epi16(s, ones));
  }
  return total;
}

// The integer dot products of one 32-block for 8 rows, per 16-half of its inputs (see block_dot).
template <Format F>
inline void half_dot(const __m256i* w, const int8_t* x, __m256i& lo, __m256i& hi) {
  if constexpr (F == Format::Q8_0) {  // u = 16 * high nibble + low nibble
    lo = _mm256_add_epi32(_mm256_slli_epi32(dot16<4>(w + 8, x), 4), dot16<4>(w, x));
    hi = _mm256_add_epi32(_mm256_slli_epi32(dot16<4>(w + 12, x + 16), 4), dot16<4>(w + 4, x + 16));
  } else {
    constexpr int GROUP = F == Format::Q6_K ? 2 : 4;
    lo = dot16<GROUP>(w, x), hi = dot16<GROUP>(w + 4, x + 16);
  }
}

inline void store8(float* y, int64_t valid, __m256 v) {
  if (valid >= 8) {
    _mm256_storeu_ps(y, v);
  } else if (valid > 0) {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(y, tmp, valid * sizeof(float));
  }
}
inline void store8(c10::BFloat16* y, int64_t valid, __m256 v) {
  // Nearest even by hand, as the AVX-512 path without AVX512-BF16 (finite values only).
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  if (valid >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), h);
  } else if (valid > 0) {
    alignas(16) uint16_t tmp[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h);
    std::memcpy(y, tmp, valid * sizeof(uint16_t));
  }
}

// One tile (16 output rows, as two halves of 8) against R activation rows starting at r0.
template <Format F, bool FINE, bool PREFETCH, int R, typename OutT>
__attribute__((noinline)) void tile_avx2(const uint8_t* w, const QuantizedRows& xq, int64_t r0, int64_t col0,
                                         int64_t valid, Output<OutT> out) {
  constexpr int64_t SUB = sub_blocks(F);
  const int64_t nb = xq.nb, k = xq.k;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b0 = 0; b0 < nb; b0 += SUB, w += chunk_bytes(F)) {
    const uint8_t* scales = w + scales_at(F);
    for (int64_t j = 0; j < SUB; ++j) {
      if constexpr (PREFETCH) prefetch_ahead<F>(w, j);
      for (int h = 0; h < 2; ++h) {
        __m256i codes[code_vectors<F>()];
        load_codes_half<F>(w + codes_at(F) + j * code_bytes(F), h, codes);
        const __m256 d =
            is_k(F) ? _mm256_loadu_ps(reinterpret_cast<const float*>(scales) + 8 * h) : half8(scales + 16 * h);
        __m256 dj = d, mj = _mm256_setzero_ps(), dj2 = d;
        if constexpr (F == Format::Q4_1) mj = half8(scales + 32 + 16 * h);
        if constexpr (F == Format::Q4_K || F == Format::Q5_K) {
          dj = _mm256_mul_ps(d, u8x8(scales + sub_scales_at(F) + 16 * j + 8 * h));
          mj = _mm256_mul_ps(_mm256_loadu_ps(reinterpret_cast<const float*>(scales + 64) + 8 * h),
                             u8x8(scales + SUB_MINS_AT + 16 * j + 8 * h));
        } else if constexpr (F == Format::Q6_K) {
          dj = _mm256_mul_ps(d, i8x8(scales + sub_scales_at(F) + 32 * j + 8 * h));
          dj2 = _mm256_mul_ps(d, i8x8(scales + sub_scales_at(F) + 16 + 32 * j + 8 * h));
        }
        for (int r = 0; r < R; ++r) {
          const int64_t b = b0 + j, at = (r0 + r) * k + b * QK, i = (r0 + r) * nb + b;
          __m256i lo, hi;
          half_dot<F>(codes, xq.q.data() + at, lo, hi);
          if constexpr (FINE) {
            __m256i lo2, hi2;
            half_dot<F>(codes, xq.q2.data() + at, lo2, hi2);
            lo = _mm256_add_epi32(_mm256_slli_epi32(lo, 8), lo2);
            hi = _mm256_add_epi32(_mm256_slli_epi32(hi, 8), hi2);
          }
          const __m256 s = _mm256_set1_ps(xq.scale[i]);
          __m256& a = acc[r][h];
          if constexpr (F == Format::Q6_K) {  // per half: (d*sc) * s * (dot - 32 * half_sum)
            const int32_t* half = &xq.half_sum[2 * i];
            const __m256i u = _mm256_sub_epi32(lo, _mm256_set1_epi32(code_offset(F) * half[0]));
            const __m256i v = _mm256_sub_epi32(hi, _mm256_set1_epi32(code_offset(F) * half[1]));
            a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(u), s), dj, a);
            a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), s), dj2, a);
          } else if constexpr (code_offset(F) != 0) {  // d * (s * dot - o * sum)
            const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), s,
                                             _mm256_set1_ps(-static_cast<float>(code_offset(F)) * xq.sum[i]));
            a = _mm256_fmadd_ps(t, d, a);
          } else {  // (d*sc) * s * dot + m * sum; K-quants subtract (dmin*mn) * sum
            const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), s);
            a = _mm256_fmadd_ps(t, dj, a);
            if constexpr (F == Format::Q4_1)
              a = _mm256_fmadd_ps(mj, _mm256_set1_ps(xq.sum[i]), a);
            else
              a = _mm256_fnmadd_ps(mj, _mm256_set1_ps(xq.sum[i]), a);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) store8(out.y + (r0 + r) * out.n + col0 + 8 * h, valid - 8 * h, acc[r][h]);
}
#endif

inline float half_to_float(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

inline float float_at(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

// Row j's code of input i (0..31) in a sub-block's tile codes (see the layout above).
inline int32_t tile_code(Format f, const uint8_t* c, int64_t j, int i) {
  const int vec = i / 4, e = i % 4;
  if (f == Format::Q8_0) return c[64 * vec + 4 * j + e];
  const uint8_t byte = c[64 * (vec % 4) + 4 * j + e];
  int32_t code = vec < 4 ? byte & 0xF : byte >> 4;
  if (has_q5_plane(f)) code |= ((c[256 + 4 * j + e] >> vec) & 1) << 4;
  if (f == Format::Q6_K) code |= ((c[256 + 64 * (vec / 4) + 4 * j + e] >> (2 * (vec % 4))) & 3) << 4;
  return code;
}

// Portable version of the same tile: reads the same layout, same arithmetic per block.
template <Format F, typename OutT>
void tile_scalar(const uint8_t* w, const QuantizedRows& xq, int64_t r0, int rows, int64_t col0, int64_t valid,
                 Output<OutT> out) {
  constexpr int64_t SUB = sub_blocks(F);
  constexpr float O = static_cast<float>(code_offset(F));
  const int64_t nb = xq.nb, k = xq.k;
  for (int r = 0; r < rows; ++r) {
    float acc[TILE] = {};
    const uint8_t* chunk = w;
    for (int64_t b0 = 0; b0 < nb; b0 += SUB, chunk += chunk_bytes(F)) {
      const uint8_t* scales = chunk + scales_at(F);
      for (int64_t jb = 0; jb < SUB; ++jb) {
        const int64_t b = b0 + jb, at = (r0 + r) * k + b * QK, i = (r0 + r) * nb + b;
        const int8_t* x = xq.q.data() + at;
        const int8_t* x2 = xq.fine ? xq.q2.data() + at : nullptr;
        const float s = xq.scale[i];
        for (int64_t j = 0; j < TILE; ++j) {
          int32_t half[2] = {0, 0};
          for (int in = 0; in < QK; ++in) {
            const int32_t code = tile_code(F, chunk + codes_at(F) + jb * code_bytes(F), j, in);
            half[in / 16] += code * (x2 ? 256 * x[in] + x2[in] : x[in]);
          }
          const float d = is_k(F) ? float_at(scales + 4 * j) : half_to_float(scales + 2 * j);
          if constexpr (F == Format::Q6_K) {
            for (int h = 0; h < 2; ++h) {
              const float sc = static_cast<float>(static_cast<int8_t>(scales[64 + 32 * jb + 16 * h + j]));
              acc[j] += static_cast<float>(half[h] - 32 * xq.half_sum[2 * i + h]) * s * (d * sc);
            }
          } else if constexpr (code_offset(F) != 0) {
            acc[j] += (static_cast<float>(half[0] + half[1]) * s - O * xq.sum[i]) * d;
          } else {
            const bool k_quant = F != Format::Q4_1;
            const float m = k_quant ? float_at(scales + 64 + 4 * j) : half_to_float(scales + 32 + 2 * j);
            const float dj = k_quant ? d * scales[128 + 16 * jb + j] : d;
            const float mj = k_quant ? -m * scales[SUB_MINS_AT + 16 * jb + j] : m;
            acc[j] += static_cast<float>(half[0] + half[1]) * s * dj;
            acc[j] += mj * xq.sum[i];
          }
        }
      }
    }
    for (int64_t j = 0; j < valid; ++j) out.y[(r0 + r) * out.n + col0 + j] = static_cast<OutT>(acc[j]);
  }
}

// One tile against `rows` (1..max_rows(F)) activation rows starting at r0.
template <Format F, bool FINE, bool PREFETCH, typename OutT>
void tile(const uint8_t* w, const QuantizedRows& xq, int rows, int64_t r0, int64_t col0, int64_t valid,
          Output<OutT> out) {
  static_assert(ROWS == 4 && max_rows(F) <= 6, "the switches below cover 1..max_rows(F) rows");
#ifdef QGEMV_AVX512
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  if constexpr (max_rows(F) > ROWS) {
    if (rows == 6) return tile_avx512<F, FINE, PREFETCH, 6>(w, xq, r0, col0, mask, out);
    if (rows == 5) return tile_avx512<F, FINE, PREFETCH, 5>(w, xq, r0, col0, mask, out);
  }
  switch (rows) {
    case 4: tile_avx512<F, FINE, PREFETCH, 4>(w, xq, r0, col0, mask, out); break;
    case 3: tile_avx512<F, FINE, PREFETCH, 3>(w, xq, r0, col0, mask, out); break;
    case 2: tile_avx512<F, FINE, PREFETCH, 2>(w, xq, r0, col0, mask, out); break;
    default: tile_avx512<F, FINE, PREFETCH, 1>(w, xq, r0, col0, mask, out); break;
  }
#elif defined(QGEMV_AVX2)
  switch (rows) {
    case 4: tile_avx2<F, FINE, PREFETCH, 4>(w, xq, r0, col0, valid, out); break;
    case 3: tile_avx2<F, FINE, PREFETCH, 3>(w, xq, r0, col0, valid, out); break;
    case 2: tile_avx2<F, FINE, PREFETCH, 2>(w, xq, r0, col0, valid, out); break;
    default: tile_avx2<F, FINE, PREFETCH, 1>(w, xq, r0, col0, valid, out); break;
  }
#else
  tile_scalar<F>(w, xq, r0, rows, col0, valid, out);
#endif
}

// Tiles [begin, end) of one part against activation rows [r_begin, r_end).
template <Format F, bool FINE, typename OutT>
void run_tiles(const Part& p, const QuantizedRows& xq, int64_t begin, int64_t end, int64_t r_begin, int64_t r_end,
               Output<OutT> out) {
  for (int64_t t = begin; t < end; ++t) {
    const uint8_t* w = p.w + t * p.tile_bytes;
    const int64_t col0 = p.col0 + t * TILE, valid = std::min(TILE, p.n - t * TILE);
    // Rows in passes as equal as they can be: 5 rows at 4 a pass as 3 + 2, not 4 + 1, whose one-row
    // pass decodes every code again for a single dot product (a 5-token verification step of a
    // Q4_K_M model: 15% less time at 8-bit activations, 8% at 16). Only small products (decodes,
    // verifications) take max_rows(F) a pass: at 64 rows 6-row passes of Q4_K were not faster.
    const int64_t total = r_end - r_begin;
    const int64_t per_pass = total <= PREFETCH_MAX_ROWS ? max_rows(F) : ROWS;
    const int64_t passes = (total + per_pass - 1) / per_pass;
    for (int64_t g = 0, r0 = r_begin; g < passes; ++g) {
      const int rows = static_cast<int>(total / passes + (g < total % passes ? 1 : 0));
      // The first pass over a tile prefetches the next ones; later passes find this tile in cache.
      // Prefetching in every pass and at every row count made 64-sequence batches 25-30% slower.
      if (g == 0 && total <= PREFETCH_MAX_ROWS)
        tile<F, FINE, true>(w, xq, rows, r0, col0, valid, out);
      else
        tile<F, FINE, false>(w, xq, rows, r0, col0, valid, out);
      r0 += rows;
    }
  }
}

// The first output column of tile t (n past the last tile).
int64_t column_of(const std::vector<Part>& parts, int64_t t, int64_t n) {
  for (const Part& p : parts)
    if (t < p.tile0 + p.tiles) return p.col0 + (t - p.tile0) * TILE;
  return n;
}

// Pause-spins waiting for the other threads' epilogue shared work before yielding between checks
// (tens of microseconds: the work is normally done long before; a preempted thread takes milliseconds).
constexpr int64_t kSpinsBeforeYield = 1024;

template <typename T>
void gemv_typed(const T* x, int64_t rows, int64_t k, const std::vector<Part>& parts, int64_t n, T* y, bool fine,
                const LinearEpilogue* epilogue) {
  const QuantizedRows xq = quantize_rows(x, rows, k, fine);
  const Part& last = parts.back();
  const int64_t tiles = last.tile0 + last.tiles;
  int64_t bytes = 0;
  for (const Part& p : parts) bytes += p.tiles * p.tile_bytes;
  Output<T> out{y, n};
  // Grain: at least ~64 KiB of weights per task so the fork/join (~2 µs) stays small against it.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, bytes / tiles));
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t r = 0; r < rows; r += ROW_CHUNK) {
      const int64_t r_end = std::min(rows, r + ROW_CHUNK);
      for (const Part& p : parts) {
        const int64_t lo = std::max(begin, p.tile0) - p.tile0, hi = std::min(end, p.tile0 + p.tiles) - p.tile0;
        if (lo >= hi) continue;
        with_format(p.format, [&](auto f) {
          if (fine)
            run_tiles<decltype(f)::value, true>(p, xq, lo, hi, r, r_end, out);
          else
            run_tiles<decltype(f)::value, false>(p, xq, lo, hi, r, r_end, out);
        });
      }
    }
  };
  if (!epilogue) {
    at::parallel_for(0, tiles, grain, run);
    return;
  }
  // With an epilogue, one region as at::parallel_for would open (the same thread count): each thread
  // does its share of the epilogue's shared work, then its contiguous share of the tiles, then, once
  // every thread's shared work is done, its columns. Shared work done first has long been done when a
  // thread's tiles end: waiting on a count of it costs a read, where a barrier after the tiles waited for
  // the slowest thread's tiles (docs/design_measurements.md#lora-adapters-inside-the-quantized-linears-region).
  const int64_t threads = at::in_parallel_region() || omp_in_parallel()
                              ? 1
                              : std::min<int64_t>(at::get_num_threads(), (tiles + grain - 1) / grain);
  if (threads <= 1) {
    epilogue->shared(0, 1);
    run(0, tiles);
    epilogue->columns(y, 0, n);
    return;
  }
  std::atomic<int64_t> shared_done{0};
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), count = omp_get_num_threads();
    const int64_t begin = tiles * t / count, end = tiles * (t + 1) / count;
    epilogue->shared(t, count);
    shared_done.fetch_add(1, std::memory_order_release);
    run(begin, end);
    // Spin, then yield the core between checks: a thread preempted before its shared work must
    // not be kept from its core by the one waiting for it.
    for (int64_t spins = 0; shared_done.load(std::memory_order_acquire) < count; ++spins) {
      if (spins < kSpinsBeforeYield)
        cpu_relax();
      else
        sched_yield();
    }
    epilogue->columns(y, column_of(parts, begin, n), column_of(parts, end, n));
  }
}

// Parts (format, rows) stacked along the output, checked against the packed bytes and in_features.
std::vector<Part> make_parts(const std::vector<std::pair<int64_t, int64_t>>& layout, const torch::Tensor& packed,
                             int64_t k, int64_t& n_total) {
  TORCH_CHECK(!layout.empty(), "quant_gemv: the layout names no matrix");
  std::vector<Part> parts;
  int64_t col = 0, tile = 0, bytes = 0;
  for (const auto& [id, n] : layout) {
    TORCH_CHECK(known_format(id), "quant_gemv: unknown block format ", id);
    const Format f = static_cast<Format>(id);
    TORCH_CHECK(k % super_weights(f) == 0, "quant_gemv: in_features must be a positive multiple of ", super_weights(f),
                " for block format ", id, ", got ", k);
    TORCH_CHECK(n > 0, "quant_gemv: out_features must be positive");
    const int64_t tiles = (n + TILE - 1) / TILE, tile_bytes = k / super_weights(f) * chunk_bytes(f);
    parts.push_back(Part{f, n, col, tile, tiles, nullptr, tile_bytes});
    col += n, tile += tiles, bytes += tiles * tile_bytes;
  }
  TORCH_CHECK(packed.numel() == bytes, "quant_gemv: packed weights do not match out_features=", col,
              " x in_features=", k);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  for (Part& p : parts) p.w = w, w += p.tiles * p.tile_bytes;
  n_total = col;
  return parts;
}

torch::Tensor gemv(const torch::Tensor& x_in, const torch::Tensor& packed,
                   const std::vector<std::pair<int64_t, int64_t>>& layout, int64_t activation_bits,
                   const LinearEpilogue* epilogue = nullptr) {
  RECORD_FUNCTION("native::quant_gemv", c10::ArrayRef<const c10::IValue>{});
  TORCH_CHECK(x_in.device().is_cpu() && packed.device().is_cpu(), "quant_gemv: CPU tensors only");
  TORCH_CHECK(x_in.dim() >= 1, "quant_gemv: x must be [..., in_features]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "quant_gemv: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "quant_gemv: packed weights must be contiguous uint8");
  TORCH_CHECK(activation_bits == 8 || activation_bits == 16, "quant_gemv: activation_bits must be 8 or 16");
  const torch::Tensor x = x_in.contiguous();
  const int64_t k = x.size(-1);
  TORCH_CHECK(k % QK == 0 && k > 0, "quant_gemv: in_features must be a positive multiple of 32, got ", k);
  int64_t n = 0;
  const std::vector<Part> parts = make_parts(layout, packed, k, n);
  const int64_t rows = x.numel() / k;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  torch::Tensor y = torch::empty(shape, x.options());
  if (rows == 0) return y;
  const bool fine = activation_bits == 16;
  if (x.scalar_type() == at::kFloat) {
    gemv_typed(x.data_ptr<float>(), rows, k, parts, n, y.data_ptr<float>(), fine, epilogue);
  } else {
    auto* xb = reinterpret_cast<const c10::BFloat16*>(x.data_ptr<at::BFloat16>());
    auto* yb = reinterpret_cast<c10::BFloat16*>(y.data_ptr<at::BFloat16>());
    gemv_typed(xb, rows, k, parts, n, yb, fine, epilogue);
  }
  return y;
}

std::vector<std::pair<int64_t, int64_t>> read_layout(const torch::Tensor& layout) {
  TORCH_CHECK(layout.scalar_type() == at::kLong && layout.dim() == 2 && layout.size(1) == 2,
              "quant_gemv: layout must be int64 [parts, 2] of (block format, out_features)");
  const torch::Tensor l = layout.contiguous();
  const int64_t* p = l.data_ptr<int64_t>();
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t i = 0; i < l.size(0); ++i) out.emplace_back(p[2 * i], p[2 * i + 1]);
  return out;
}

// -- rows ---------------------------------------------------------------------------------------
// Row `row` of one matrix's tiles, dequantized to fp32 as the gguf package's dequantize_blocks
// computes it: Q4_0 / Q5_0 / Q8_0 d * (u - o); Q4_1 d * u + m; Q4_K / Q5_K (d * sc) * u - (dmin * mn);
// Q6_K (d * sc) * (u - 32). The same bits whether or not the compiler fuses a product into the
// addition after it (GCC makes FMAs by default): every product before an addition is exact in fp32
// (an fp16 d or dmin, 11 significant bits, times integers of at most 6 + 5 bits), so the addition is
// the only rounding either way.
template <Format F>
void dequantize_row(const uint8_t* packed, int64_t nsb, int64_t row, float* out) {
  const int64_t j = row % TILE;
  const uint8_t* chunk = packed + row / TILE * nsb * chunk_bytes(F);
  for (int64_t sb = 0; sb < nsb; ++sb, chunk += chunk_bytes(F)) {
    const uint8_t* scales = chunk + scales_at(F);
    const float d = is_k(F) ? float_at(scales + 4 * j) : half_to_float(scales + 2 * j);
    for (int64_t b = 0; b < sub_blocks(F); ++b) {
      const uint8_t* codes = chunk + codes_at(F) + b * code_bytes(F);
      float* o = out + (sb * sub_blocks(F) + b) * QK;
      for (int i = 0; i < QK; ++i) {
        const float u = static_cast<float>(tile_code(F, codes, j, i));
        if constexpr (F == Format::Q4_1) {
          o[i] = d * u + half_to_float(scales + 32 + 2 * j);
        } else if constexpr (F == Format::Q4_K || F == Format::Q5_K) {
          const float dj = d * static_cast<float>(scales[sub_scales_at(F) + 16 * b + j]);
          const float mj = float_at(scales + 64 + 4 * j) * static_cast<float>(scales[SUB_MINS_AT + 16 * b + j]);
          o[i] = dj * u - mj;
        } else if constexpr (F == Format::Q6_K) {
          const float sc =
              static_cast<float>(static_cast<int8_t>(scales[sub_scales_at(F) + 32 * b + 16 * (i / 16) + j]));
          o[i] = (d * sc) * (u - 32.0f);
        } else {
          o[i] = d * (u - static_cast<float>(code_offset(F)));
        }
      }
    }
  }
}

// Rows `ids` of a packed matrix (one part), dequantized: the embedding lookup of a table kept as tiles.
torch::Tensor gather_rows(const torch::Tensor& packed, const torch::Tensor& layout, const torch::Tensor& ids_in,
                          int64_t in_features, at::ScalarType dtype) {
  RECORD_FUNCTION("native::quant_rows", c10::ArrayRef<const c10::IValue>{});
  TORCH_CHECK(packed.device().is_cpu() && ids_in.device().is_cpu(), "quant_rows: CPU tensors only");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "quant_rows: packed weights must be contiguous uint8");
  TORCH_CHECK(ids_in.scalar_type() == at::kLong || ids_in.scalar_type() == at::kInt,
              "quant_rows: ids must be int64 or int32");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "quant_rows: dtype must be float32, bfloat16 or float16");
  const std::vector<std::pair<int64_t, int64_t>> parts_layout = read_layout(layout);
  TORCH_CHECK(parts_layout.size() == 1, "quant_rows: the layout must name one matrix");
  int64_t n = 0;
  const std::vector<Part> parts = make_parts(parts_layout, packed, in_features, n);
  const Part& p = parts.front();
  const torch::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t count = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "quant_rows: row id ", id[i], " is outside the matrix's ", n, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(in_features);
  torch::Tensor out = torch::empty(shape, ids.options().dtype(dtype));
  const int64_t nsb = in_features / super_weights(p.format);
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(in_features);
    for (int64_t i = begin; i < end; ++i) {
      with_format(p.format, [&](auto f) { dequantize_row<decltype(f)::value>(p.w, nsb, id[i], row.data()); });
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "quant_rows", [&] {
        scalar_t* o = out.data_ptr<scalar_t>() + i * in_features;
        for (int64_t c = 0; c < in_features; ++c) o[c] = static_cast<scalar_t>(row[c]);
      });
    }
  });
  return out;
}

// -- packing ------------------------------------------------------------------------------------
inline void put_half(uint8_t* p, float v) {
  const c10::Half h(v);
  std::memcpy(p, &h, 2);
}

// Row j's 32 codes (unsigned, as the kernel multiplies them) into a sub-block's tile codes.
void put_codes(Format f, uint8_t* c, int64_t j, const uint8_t* codes) {
  for (int i = 0; i < QK; ++i) {
    const int vec = i / 4, e = i % 4;
    const uint8_t u = codes[i];
    if (f == Format::Q8_0) {
      c[64 * vec + 4 * j + e] = u;
      continue;
    }
    c[64 * (vec % 4) + 4 * j + e] |= vec < 4 ? (u & 0xF) : (u & 0xF) << 4;
    if (has_q5_plane(f)) c[256 + 4 * j + e] |= ((u >> 4) & 1) << vec;
    if (f == Format::Q6_K) c[256 + 64 * (vec / 4) + 4 * j + e] |= ((u >> 4) & 3) << (2 * (vec % 4));
  }
}

// Lays n rows of nsb super-blocks out as TILE-row tiles of `format`: fill(chunk, j, row, sb) writes
// row `row`'s super-block sb as member j of its tile's chunk; rows past n stay zero.
template <typename Fill>
torch::Tensor pack_tiles(Format format, int64_t n, int64_t nsb, Fill fill) {
  const int64_t tiles = (n + TILE - 1) / TILE, bytes = chunk_bytes(format);
  torch::Tensor out = torch::zeros({tiles * nsb * bytes}, torch::dtype(at::kByte));
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t sb = 0; sb < nsb; ++sb)
        for (int64_t j = 0; j < TILE && t * TILE + j < n; ++j) fill(o + (t * nsb + sb) * bytes, j, t * TILE + j, sb);
  });
  return out;
}

void check_pack_inputs(const torch::Tensor& codes, const torch::Tensor& scales, at::ScalarType code_type) {
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu(), "quant_pack: CPU tensors only");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == code_type, "quant_pack: codes must be 2-D ", code_type);
  TORCH_CHECK(codes.size(1) % QK == 0 && codes.size(1) > 0,
              "quant_pack: in_features must be a positive multiple of 32");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) / QK,
              "quant_pack: scales must be [out_features, in_features / 32]");
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
  return pack_tiles(Format::Q4_1, n, nb, [&](uint8_t* chunk, int64_t j, int64_t row, int64_t b) {
    put_codes(Format::Q4_1, chunk, j, c + row * k + b * QK);
    put_half(chunk + 256 + 2 * j, d[row * nb + b]);
    put_half(chunk + 288 + 2 * j, m[row * nb + b]);
  });
}

// codes int8 [n, k], scales d float [n, k/32] -> Q8_0 tiles (codes stored as q + 128).
torch::Tensor pack_q8_0(const torch::Tensor& codes_in, const torch::Tensor& scales_in) {
  check_pack_inputs(codes_in, scales_in, at::kChar);
  const torch::Tensor codes = codes_in.contiguous(), scales = scales_in.to(at::kFloat).contiguous();
  const int64_t n = codes.size(0), k = codes.size(1), nb = k / QK;
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* d = scales.data_ptr<float>();
  return pack_tiles(Format::Q8_0, n, nb, [&](uint8_t* chunk, int64_t j, int64_t row, int64_t b) {
    uint8_t u[QK];
    for (int i = 0; i < QK; ++i) u[i] = static_cast<uint8_t>(c[row * k + b * QK + i] + 128);
    put_codes(Format::Q8_0, chunk, j, u);
    put_half(chunk + 512 + 2 * j, d[row * nb + b]);
  });
}

// One GGUF block (super-block for K-quants) of row member j -> its tile chunk. The fp16 scales are
// copied as bytes; codes become the unsigned values the kernel multiplies (layouts: ggml-common.h,
// as the gguf package's dequantization reads them).
void fill_from_gguf(Format f, uint8_t* chunk, int64_t j, const uint8_t* src) {
  uint8_t codes[256];
  uint8_t* scales = chunk + scales_at(f);
  if (is_k(f)) {  // d, and dmin, as fp32 (see scale_bytes)
    const float d = half_to_float(f == Format::Q6_K ? src + 208 : src);
    std::memcpy(scales + 4 * j, &d, 4);
  } else {
    std::memcpy(scales + 2 * j, src, 2);
  }
  auto nibbles = [&](const uint8_t* qs) {  // 32-blocks: low nibbles are weights 0..15, high 16..31
    for (int i = 0; i < 16; ++i) codes[i] = qs[i] & 0xF, codes[16 + i] = qs[i] >> 4;
  };
  switch (f) {
    case Format::Q4_0: nibbles(src + 2); break;
    case Format::Q4_1:
      std::memcpy(scales + 32 + 2 * j, src + 2, 2);
      nibbles(src + 4);
      break;
    case Format::Q5_0: {
      uint32_t qh;
      std::memcpy(&qh, src + 2, 4);
      nibbles(src + 6);
      for (int i = 0; i < 32; ++i) codes[i] |= ((qh >> i) & 1) << 4;
      break;
    }
    case Format::Q8_0:
      for (int i = 0; i < 32; ++i) codes[i] = static_cast<uint8_t>(static_cast<int8_t>(src[2 + i]) + 128);
      break;
    case Format::Q4_K:
    case Format::Q5_K: {
      const float dmin = half_to_float(src + 2);
      std::memcpy(scales + 64 + 4 * j, &dmin, 4);
      const uint8_t* s = src + 4;  // 12 bytes: 8 six-bit scales and 8 six-bit mins
      for (int sb = 0; sb < 8; ++sb) {
        const uint8_t sc = sb < 4 ? s[sb] & 63 : (s[sb + 4] & 0xF) | ((s[sb - 4] >> 6) << 4);
        const uint8_t mn = sb < 4 ? s[sb + 4] & 63 : (s[sb + 4] >> 4) | ((s[sb] >> 6) << 4);
        scales[sub_scales_at(f) + 16 * sb + j] = sc, scales[SUB_MINS_AT + 16 * sb + j] = mn;
      }
      const uint8_t* qh = src + 16;  // Q5_K: bit sb of byte e is weight e's 5th bit in sub-block sb
      const uint8_t* qs = f == Format::Q4_K ? src + 16 : src + 48;  // 32 bytes per pair of sub-blocks
      for (int sb = 0; sb < 8; ++sb)
        for (int e = 0; e < 32; ++e) {
          const uint8_t byte = qs[32 * (sb / 2) + e];
          codes[32 * sb + e] = sb % 2 == 0 ? byte & 0xF : byte >> 4;
          if (f == Format::Q5_K) codes[32 * sb + e] |= ((qh[e] >> sb) & 1) << 4;
        }
      break;
    }
    case Format::Q6_K: {
      const uint8_t *ql = src, *qh = src + 128;
      for (int h = 0; h < 16; ++h) scales[sub_scales_at(f) + 16 * h + j] = src[192 + h];
      for (int w = 0; w < 256; ++w) {  // halves of 128: ql 64 bytes (two nibbles), qh 32 bytes (four pairs)
        const int half = w / 128, r = w % 128;
        const uint8_t low = (ql[64 * half + r % 64] >> (4 * (r / 64))) & 0xF;
        const uint8_t high = (qh[32 * half + r % 32] >> (2 * (r / 32))) & 3;
        codes[w] = low | (high << 4);
      }
      break;
    }
  }
  for (int64_t sb = 0; sb < sub_blocks(f); ++sb)
    put_codes(f, chunk + codes_at(f) + sb * code_bytes(f), j, codes + QK * sb);
}

// A GGUF tensor's blocks as stored in the file, uint8 [out_features, bytes per row] -> tiles.
torch::Tensor pack_gguf(int64_t block_format, const torch::Tensor& blocks_in, int64_t in_features) {
  TORCH_CHECK(known_format(block_format), "quant_pack_gguf: no kernel for GGML block type ", block_format);
  const Format f = static_cast<Format>(block_format);
  TORCH_CHECK(blocks_in.device().is_cpu() && blocks_in.scalar_type() == at::kByte && blocks_in.dim() == 2,
              "quant_pack_gguf: blocks must be a 2-D uint8 CPU tensor [out_features, bytes per row]");
  TORCH_CHECK(in_features > 0 && in_features % super_weights(f) == 0,
              "quant_pack_gguf: in_features must be a positive multiple of ", super_weights(f), " for block type ",
              block_format, ", got ", in_features);
  const int64_t nsb = in_features / super_weights(f), row_bytes = nsb * file_block_bytes(f);
  TORCH_CHECK(blocks_in.size(1) == row_bytes, "quant_pack_gguf: ", row_bytes, " bytes per row expected for ",
              in_features, " inputs of block type ", block_format, ", got ", blocks_in.size(1));
  const torch::Tensor blocks = blocks_in.contiguous();
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  return pack_tiles(f, blocks.size(0), nsb, [&](uint8_t* chunk, int64_t j, int64_t row, int64_t sb) {
    fill_from_gguf(f, chunk, j, src + row * row_bytes + sb * file_block_bytes(f));
  });
}

std::vector<int64_t> gguf_formats() {
  std::vector<int64_t> ids;
  for (Format f : kFormats) ids.push_back(static_cast<int64_t>(f));
  return ids;
}

const char* isa() {
#if defined(QGEMV_AVX512)
  return "avx512_vnni";
#elif defined(QGEMV_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

torch::Tensor quant_gemv(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& layout,
                         int64_t activation_bits) {
  return gemv(x, packed, read_layout(layout), activation_bits);
}

torch::Tensor quant_gemv_then(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& layout,
                              int64_t activation_bits, const LinearEpilogue& epilogue) {
  return gemv(x, packed, read_layout(layout), activation_bits, &epilogue);
}

void register_quant_gemv(pybind11::module_& m) {
  m.def("quant_pack_q4_1", &pack_q4_1, "codes uint8 [N,K] (0..15), scales, mins float [N,K/32] -> packed Q4_1 tiles",
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("mins"));
  m.def("quant_pack_q8_0", &pack_q8_0, "codes int8 [N,K], scales float [N,K/32] -> packed Q8_0 tiles",
        pybind11::arg("codes"), pybind11::arg("scales"));
  m.def("quant_pack_gguf", &pack_gguf,
        "a GGUF tensor's blocks uint8 [N, bytes per row] of GGML type block_format (one of quant_gguf_formats) "
        "-> packed tiles of that format",
        pybind11::arg("block_format"), pybind11::arg("blocks"), pybind11::arg("in_features"));
  m.def("quant_gguf_formats", &gguf_formats, "the GGML block types the kernels multiply packed");
  m.def("quant_rows", &gather_rows,
        "rows `ids` (any shape) of one packed matrix (layout [[block type, out_features]]) dequantized to dtype: "
        "[*ids.shape, in_features], the gguf package's values",
        pybind11::arg("packed"), pybind11::arg("layout"), pybind11::arg("ids"), pybind11::arg("in_features"),
        pybind11::arg("dtype"), ReleaseGil());
  m.def("quant_gemv", &quant_gemv,
        "x [..., K] float32/bfloat16 @ packed weights^T -> [..., sum of out_features] in x's dtype; layout int64 "
        "[parts, 2] lists the stacked matrices' (GGML block type, out_features); activations rounded per 32-block "
        "to int8 (activation_bits=8, llama.cpp's Q8_1) or to two int8 parts (16)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("layout"), pybind11::arg("activation_bits") = 16,
        ReleaseGil());
  m.def(
      "quant_gemv_q4_1",
      [](const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features, int64_t activation_bits) {
        return gemv(x, packed, {{static_cast<int64_t>(Format::Q4_1), out_features}}, activation_bits);
      },
      "quant_gemv of one Q4_1 matrix (quant_pack_q4_1's tiles)", pybind11::arg("x"), pybind11::arg("packed"),
      pybind11::arg("out_features"), pybind11::arg("activation_bits") = 16, ReleaseGil());
  m.def(
      "quant_gemv_q8_0",
      [](const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features, int64_t activation_bits) {
        return gemv(x, packed, {{static_cast<int64_t>(Format::Q8_0), out_features}}, activation_bits);
      },
      "quant_gemv of one Q8_0 matrix (quant_pack_q8_0's tiles)", pybind11::arg("x"), pybind11::arg("packed"),
      pybind11::arg("out_features"), pybind11::arg("activation_bits") = 16, ReleaseGil());
  m.def("quant_gemv_isa", &isa, "instruction set the quantized kernels were built for: avx512_vnni or scalar");
}
