// Paged attention over a flattened batch whose K/V live in a paged cache, reading the cache's
// blocks in place: decodes (one query), speculative verifications (a few) and prefill chunks
// (many) alike, each query seeing the positions up to its own.
//
// A work item is (sequence, tile of its queries, segment of its context), all KV heads (or one,
// when the batch is too small to keep the threads busy otherwise): for each KV head, the query
// heads that share it and the tile's queries form the rows of a small matrix, and the item walks
// the block table in tiles of 16 positions (reading each block's rows of its heads together).
// Per key tile: the keys are transposed to [head_dim][16] (fp32, or bf16 pairs for a bf16 cache)
// so that the scores of 16 positions for a row are one vector of dot products shared by all rows;
// an online softmax (running max and sum per row, flash-attention style) turns them into weights;
// the weighted values are accumulated in registers, several rows at a time. Sums are fp32 whatever
// the cache dtype; an int8 / fp8 cache is converted in registers as its stored values, its
// per-KV-head scale folded into the score scale (keys) and into the output (values). Long contexts
// are cut into segments merged at the end (flash-decoding), so that one long prompt keeps both
// threads busy. Items differ a lot in cost, so threads take them heaviest first from a shared
// counter. A row's result is batch invariant: it does not depend on the batch, the thread count,
// or which other queries share its tile (how its prompt was chunked, whether its prefix came
// from the cache), because every row sums in one fixed order and contexts are cut at fixed
// positions (docs/determinism.md).
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace {

constexpr int64_t KEY_TILE = 16;
// Rows (queries x query heads per KV head) of one work item: bounds its buffers to a few KB.
constexpr int64_t MAX_ROWS = 32;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// Quantized cache elements, read as the stored value (the per-head scale is applied outside:
// folded into the score scale for keys, into the output for values).
struct KvInt8 {
  int8_t bits;
  explicit operator float() const { return static_cast<float>(bits); }
};
struct KvE4M3 {  // float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities
  uint8_t bits;
  explicit operator float() const {
    const int e = (bits >> 3) & 0xF, m = bits & 7;
    const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
    return bits & 0x80 ? -mag : mag;
  }
};
struct KvE5M2 {  // float8_e5m2: the high byte of an IEEE half
  uint8_t bits;
  explicit operator float() const {
    c10::Half h;
    h.x = static_cast<uint16_t>(bits << 8);
    return static_cast<float>(h);
  }
};
template <typename T>
inline void to_float(float* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512i load16_bytes(const void* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512 load16(const KvInt8* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const KvE5M2* p) {
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_slli_epi32(load16_bytes(p), 8)));
}
// e4m3 normals: exponent and mantissa bits moved into fp32's with the bias difference (120) added;
// subnormals (exponent 0): mantissa * 2^-9.
inline __m512 load16(const KvE4M3* p) {
  const __m512i b = load16_bytes(p);
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.0f / 512));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512 v = _mm512_mask_blend_ps(is_sub, normal, subnormal);
  return _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(v), _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24)));
}

// In place: r[i] lane j <- r[j] lane i.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  // u[4g + c], 128-bit lane l: column 4l + c of rows 4g .. 4g + 3.
  __m512 u[16];
  for (int g = 0; g < 4; ++g) {
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44),
                 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
}

// scores[r][0..16) = q[r] . keys_t[:, 0..16) for N rows, with S partial sums per row so that
// enough independent FMA chains are in flight.
template <int N, int S>
inline void scores_rows(float* scores, const float* q, const float* keys_t, int64_t head_dim) {
  __m512 acc[N][S];
  for (int i = 0; i < N; ++i)
    for (int s = 0; s < S; ++s) acc[i][s] = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + S <= head_dim; d += S)
    for (int s = 0; s < S; ++s) {
      const __m512 k = _mm512_loadu_ps(keys_t + (d + s) * KEY_TILE);
      for (int i = 0; i < N; ++i) acc[i][s] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * head_dim + d + s]), k, acc[i][s]);
    }
  for (; d < head_dim; ++d) {
    const __m512 k = _mm512_loadu_ps(keys_t + d * KEY_TILE);
    for (int i = 0; i < N; ++i) acc[i][0] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * head_dim + d]), k, acc[i][0]);
  }
  for (int i = 0; i < N; ++i) {
    for (int s = 1; s < S; ++s) acc[i][0] = _mm512_add_ps(acc[i][0], acc[i][s]);
    _mm512_storeu_ps(scores + i * KEY_TILE, acc[i][0]);
  }
}

// Every row sums its dot products in the same order (kScoreSums partial sums, combined in index
// order), whatever the number of rows: a row's score never depends on what shares its tile (the
// batch, the chunking of its prompt). Rows go kScoreRows at a time, kScoreRows * kScoreSums
// accumulators fitting the registers.
constexpr int kScoreRows = 6;
constexpr int kScoreSums = 4;

inline void scores_all(float* scores, const float* q, const float* keys_t, int64_t head_dim, int64_t rows) {
  int64_t r = 0;
  for (; r + kScoreRows <= rows; r += kScoreRows)
    scores_rows<kScoreRows, kScoreSums>(scores + r * KEY_TILE, q + r * head_dim, keys_t, head_dim);
  float* s = scores + r * KEY_TILE;
  const float* qr = q + r * head_dim;
  switch (rows - r) {
    case 1: return scores_rows<1, kScoreSums>(s, qr, keys_t, head_dim);
    case 2: return scores_rows<2, kScoreSums>(s, qr, keys_t, head_dim);
    case 3: return scores_rows<3, kScoreSums>(s, qr, keys_t, head_dim);
    case 4: return scores_rows<4, kScoreSums>(s, qr, keys_t, head_dim);
    case 5: return scores_rows<5, kScoreSums>(s, qr, keys_t, head_dim);
    default: return;
  }
}

// acc[r] = acc[r] * rescale[r] + sum_t weights[r][t] * values[t] for N rows of P 16-float pieces;
// value rows straight from the cache (`stride` apart), converted in registers.
template <int N, int P, typename T>
inline void accumulate_rows(float* acc, const float* rescale, const float* weights, const T* values, int64_t stride,
                            int64_t n) {
  __m512 a[N][P];
  for (int i = 0; i < N; ++i) {
    const __m512 s = _mm512_set1_ps(rescale[i]);
    for (int p = 0; p < P; ++p) a[i][p] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * P * 16 + p * 16), s);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[P];
    for (int p = 0; p < P; ++p) v[p] = load16(values + t * stride + p * 16);
    for (int i = 0; i < N; ++i) {
      const __m512 w = _mm512_set1_ps(weights[i * KEY_TILE + t]);
      for (int p = 0; p < P; ++p) a[i][p] = _mm512_fmadd_ps(w, v[p], a[i][p]);
    }
  }
  for (int i = 0; i < N; ++i)
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(acc + i * P * 16 + p * 16, a[i][p]);
}

// Rows in blocks whose N * P accumulators (plus P values) fit the 32 vector registers.
template <int P, typename T>
void accumulate_all(float* acc, const float* rescale, const float* weights, const T* values, int64_t stride, int64_t n,
                    int64_t rows) {
  constexpr int N = P <= 4 ? 6 : 3;
  int64_t r = 0;
  for (; r + N <= rows; r += N)
    accumulate_rows<N, P>(acc + r * P * 16, rescale + r, weights + r * KEY_TILE, values, stride, n);
  for (; r + 2 <= rows; r += 2)
    accumulate_rows<2, P>(acc + r * P * 16, rescale + r, weights + r * KEY_TILE, values, stride, n);
  if (r < rows) accumulate_rows<1, P>(acc + r * P * 16, rescale + r, weights + r * KEY_TILE, values, stride, n);
}
#endif

// bf16 caches on CPUs with AVX512-BF16: both products take bf16 pairs as they are (VDPBF16PS,
// fp32 sums), ~3x fewer instructions than converting every key and value to fp32. Queries and keys
// are exact (the model computes them in bf16); the softmax weights are rounded to bf16 for the
// value product, as GPU flash attention does, while their running sum stays fp32.
#if defined(__AVX512BF16__)
#define ATTENTION_BF16_PAIRS 1
inline __m512bh as_pairs(__m512i v) { return (__m512bh)v; }

// keys_p[i][t] = dims 2i and 2i + 1 of key t as one 32-bit pair; keys t >= n are zero.
inline void load_key_pairs(uint32_t* keys_p, const c10::BFloat16* keys, int64_t stride, int64_t n, int64_t head_dim) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
    __m512 r[16];  // 16 pairs per key, moved as 32-bit lanes
    for (int64_t t = 0; t < 16; ++t)
      r[t] = t < n ? _mm512_castsi512_ps(_mm512_loadu_si512(keys + t * stride + d0)) : _mm512_setzero_ps();
    transpose16(r);
    for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(keys_p + (d0 / 2 + i) * KEY_TILE), r[i]);
  }
}

// scores[r][0..16) = scale * q[r] . keys for N rows of `pairs` query pairs, S partial sums per row.
template <int N, int S>
inline void pair_scores_rows(float* scores, const uint32_t* q, const uint32_t* keys_p, int64_t pairs, float scale) {
  __m512 acc[N][S];
  for (int i = 0; i < N; ++i)
    for (int s = 0; s < S; ++s) acc[i][s] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; p += S)
    for (int s = 0; s < S; ++s) {
      const __m512bh k = as_pairs(_mm512_loadu_si512(keys_p + (p + s) * KEY_TILE));
      for (int i = 0; i < N; ++i)
        acc[i][s] = _mm512_dpbf16_ps(acc[i][s], k, as_pairs(_mm512_set1_epi32(static_cast<int>(q[i * pairs + p + s]))));
    }
  for (int i = 0; i < N; ++i) {
    for (int s = 1; s < S; ++s) acc[i][0] = _mm512_add_ps(acc[i][0], acc[i][s]);
    _mm512_storeu_ps(scores + i * KEY_TILE, _mm512_mul_ps(acc[i][0], _mm512_set1_ps(scale)));
  }
}

// The same row blocking and summation order as scores_all (kScoreSums divides `pairs`, a multiple of 16).
inline void pair_scores_all(float* scores, const uint32_t* q, const uint32_t* keys_p, int64_t pairs, int64_t rows,
                            float scale) {
  int64_t r = 0;
  for (; r + kScoreRows <= rows; r += kScoreRows)
    pair_scores_rows<kScoreRows, kScoreSums>(scores + r * KEY_TILE, q + r * pairs, keys_p, pairs, scale);
  float* s = scores + r * KEY_TILE;
  const uint32_t* qr = q + r * pairs;
  switch (rows - r) {
    case 1: return pair_scores_rows<1, kScoreSums>(s, qr, keys_p, pairs, scale);
    case 2: return pair_scores_rows<2, kScoreSums>(s, qr, keys_p, pairs, scale);
    case 3: return pair_scores_rows<3, kScoreSums>(s, qr, keys_p, pairs, scale);
    case 4: return pair_scores_rows<4, kScoreSums>(s, qr, keys_p, pairs, scale);
    case 5: return pair_scores_rows<5, kScoreSums>(s, qr, keys_p, pairs, scale);
    default: return;
  }
}

// acc[r] = acc[r] * rescale[r] + sum_t w[r][t] * values[t] for N rows of C 32-dim chunks, two
// positions per product: their value rows interleaved 16 bits at a time, their weights one
// broadcast pair. The interleave works within 128-bit lanes, so the accumulators hold each chunk's
// dims permuted (see unpermute_pairs).
template <int N, int C>
inline void pair_accumulate_rows(float* acc, const float* rescale, const uint32_t* w, const c10::BFloat16* values,
                                 int64_t stride, int64_t n) {
  __m512 a[N][2 * C];
  for (int i = 0; i < N; ++i) {
    const __m512 s = _mm512_set1_ps(rescale[i]);
    for (int p = 0; p < 2 * C; ++p) a[i][p] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * 32 * C + p * 16), s);
  }
  for (int64_t t = 0; t < n; t += 2) {
    __m512i lo[C], hi[C];
    for (int c = 0; c < C; ++c) {
      const __m512i first = _mm512_loadu_si512(values + t * stride + 32 * c);
      const __m512i second =
          t + 1 < n ? _mm512_loadu_si512(values + (t + 1) * stride + 32 * c) : _mm512_setzero_si512();
      lo[c] = _mm512_unpacklo_epi16(first, second);
      hi[c] = _mm512_unpackhi_epi16(first, second);
    }
    for (int i = 0; i < N; ++i) {
      const __m512bh wt = as_pairs(_mm512_set1_epi32(static_cast<int>(w[i * KEY_TILE / 2 + t / 2])));
      for (int c = 0; c < C; ++c) {
        a[i][2 * c] = _mm512_dpbf16_ps(a[i][2 * c], as_pairs(lo[c]), wt);
        a[i][2 * c + 1] = _mm512_dpbf16_ps(a[i][2 * c + 1], as_pairs(hi[c]), wt);
      }
    }
  }
  for (int i = 0; i < N; ++i)
    for (int p = 0; p < 2 * C; ++p) _mm512_storeu_ps(acc + i * 32 * C + p * 16, a[i][p]);
}

template <int C>
void pair_accumulate_all(float* acc, const float* rescale, const uint32_t* w, const c10::BFloat16* values,
                         int64_t stride, int64_t n, int64_t rows) {
  constexpr int N = C <= 2 ? 6 : 2;  // N * 2C accumulators + 2C interleaved values in 32 registers
  int64_t r = 0;
  for (; r + N <= rows; r += N)
    pair_accumulate_rows<N, C>(acc + r * 32 * C, rescale + r, w + r * KEY_TILE / 2, values, stride, n);
  for (; r < rows; ++r)
    pair_accumulate_rows<1, C>(acc + r * 32 * C, rescale + r, w + r * KEY_TILE / 2, values, stride, n);
}

// Undoes pair_accumulate_rows' order: in chunk c, lane 4k + j of the low half holds dim 8k + j and
// of the high half dim 8k + 4 + j.
inline void unpermute_pairs(float* acc, int64_t head_dim) {
  float chunk[32];
  for (int64_t c = 0; c < head_dim; c += 32) {
    for (int lane = 0; lane < 16; ++lane) {
      chunk[8 * (lane / 4) + lane % 4] = acc[c + lane];
      chunk[8 * (lane / 4) + 4 + lane % 4] = acc[c + 16 + lane];
    }
    std::copy_n(chunk, 32, acc + c);
  }
}
#endif

// One work item's state and the tile steps. Buffers are per thread and reused across items.
struct Tile {
  int64_t head_dim = 0, rows = 0;
  float scale = 1.0f;
  // A sliding window: row r sees only the `window` positions up to row_last[r]; 0: its whole context.
  int64_t window = 0;
  // bf16 pair path (see pair_scores_rows): queries, transposed keys and weights as bf16 pairs.
  bool pairs = false;
  std::vector<float> q, acc, max, sum, rescale, scores, keys_t, values;
  std::vector<uint32_t> q_pairs, keys_p, w_pairs;

  template <typename T>
  static bool pair_path(int64_t d) {
#ifdef ATTENTION_BF16_PAIRS
    return std::is_same_v<T, c10::BFloat16> && (d == 64 || d == 128);
#else
    return false;
#endif
  }

  template <typename T>
  void reset(int64_t d, int64_t r, float score_scale, int64_t sliding_window) {
    head_dim = d, rows = r, scale = score_scale, window = sliding_window, pairs = pair_path<T>(d);
    acc.assign(r * d, 0.0f);
    max.assign(r, NEG_INF);
    sum.assign(r, 0.0f);
    rescale.resize(r);
    scores.resize(r * KEY_TILE);
    if (pairs) {
      q_pairs.resize(r * d / 2);
      keys_p.resize(d / 2 * KEY_TILE);
      w_pairs.resize(r * KEY_TILE / 2);
    } else {
      q.resize(r * d);
      keys_t.resize(d * KEY_TILE);
    }
  }

  // Row r's query (one query head's head_dim values).
  template <typename T>
  void load_query(int64_t r, const T* src) {
    if (pairs) {
      std::memcpy(q_pairs.data() + r * head_dim / 2, src, head_dim * sizeof(T));  // T is bf16 here
      return;
    }
    for (int64_t d = 0; d < head_dim; ++d) q[r * head_dim + d] = static_cast<float>(src[d]) * scale;
  }

  // Row r's weighted values (not yet divided by the sum), in dim order once the item is done.
  const float* finish_row(int64_t r) {
    float* a = acc.data() + r * head_dim;
#ifdef ATTENTION_BF16_PAIRS
    if (pairs) unpermute_pairs(a, head_dim);
#endif
    return a;
  }

  // One tile of n (<= 16) positions starting at `first`, their key and value rows one `stride`
  // apart; row r may see positions <= row_last[r] (and > row_last[r] - window with a window).
  template <typename T>
  void step(const T* keys, const T* vals, int64_t stride, int64_t first, int64_t n, const int64_t* row_last) {
#ifdef ATTENTION_BF16_PAIRS
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (pairs) return pair_step(keys, vals, stride, first, n, row_last);
    }
#endif
    load_keys(keys, stride, n);
#if defined(__AVX512F__)
    scores_all(scores.data(), q.data(), keys_t.data(), head_dim, rows);
#else
    // The tile's 16 positions are the vector lanes: with d innermost the loop is one chain of
    // dependent scalar adds, whose speed then hangs on where the loop happens to be aligned.
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q.data() + r * head_dim;
#if defined(__AVX2__)
      // Multiply, then add (no FMA): the same roundings as the scalar loop below.
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_dim; ++d) {
        const __m256 qd = _mm256_set1_ps(qr[d]);
        const float* k = keys_t.data() + d * KEY_TILE;
        lo = _mm256_add_ps(lo, _mm256_mul_ps(qd, _mm256_loadu_ps(k)));
        hi = _mm256_add_ps(hi, _mm256_mul_ps(qd, _mm256_loadu_ps(k + 8)));
      }
      _mm256_storeu_ps(scores.data() + r * KEY_TILE, lo);
      _mm256_storeu_ps(scores.data() + r * KEY_TILE + 8, hi);
#else
      float s[KEY_TILE] = {};
      for (int64_t d = 0; d < head_dim; ++d) {
        const float* k = keys_t.data() + d * KEY_TILE;
        for (int64_t t = 0; t < KEY_TILE; ++t) s[t] += qr[d] * k[t];
      }
      std::copy(s, s + KEY_TILE, scores.data() + r * KEY_TILE);
#endif
    }
#endif
    softmax_update(first, n, row_last);
    accumulate(vals, stride, n);
  }

 private:
#ifdef ATTENTION_BF16_PAIRS
  void pair_step(const c10::BFloat16* keys, const c10::BFloat16* vals, int64_t stride, int64_t first, int64_t n,
                 const int64_t* row_last) {
    load_key_pairs(keys_p.data(), keys, stride, n, head_dim);
    pair_scores_all(scores.data(), q_pairs.data(), keys_p.data(), head_dim / 2, rows, scale);
    softmax_update(first, n, row_last);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256i w = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(scores.data() + r * KEY_TILE));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w_pairs.data() + r * KEY_TILE / 2), w);
    }
    if (head_dim == 64)
      pair_accumulate_all<2>(acc.data(), rescale.data(), w_pairs.data(), vals, stride, n, rows);
    else
      pair_accumulate_all<4>(acc.data(), rescale.data(), w_pairs.data(), vals, stride, n, rows);
  }
#endif

  // keys_t[d][t] = key t's component d in fp32, positions n .. 15 zero.
  template <typename T>
  void load_keys(const T* keys, int64_t stride, int64_t n) {
#if defined(__AVX512F__)
    if constexpr (!std::is_same_v<T, double>) {
      if (head_dim % 16 == 0) {
        for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
          __m512 r[16];
          for (int64_t t = 0; t < 16; ++t) r[t] = t < n ? load16(keys + t * stride + d0) : _mm512_setzero_ps();
          transpose16(r);
          for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(keys_t.data() + (d0 + i) * KEY_TILE, r[i]);
        }
        return;
      }
    }
#endif
    std::fill(keys_t.begin(), keys_t.end(), 0.0f);
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < head_dim; ++d) keys_t[d * KEY_TILE + t] = static_cast<float>(keys[t * stride + d]);
  }

  // Online softmax: scores become weights relative to each row's running maximum; rescale[r]
  // is what the row's earlier sums must be multiplied by. A tile none of whose positions a row
  // sees leaves the row's sums exactly as they were (rescale 1, weights 0): so a row's result does
  // not depend on whether such tiles were walked (which other rows share its work item).
  void softmax_update(int64_t first, int64_t n, const int64_t* row_last) {
    for (int64_t r = 0; r < rows; ++r) {
      float* s = scores.data() + r * KEY_TILE;
      const int64_t end = std::min<int64_t>(n, row_last[r] - first + 1);
      const int64_t begin = window > 0 ? std::max<int64_t>(0, row_last[r] - window + 1 - first) : 0;
      if (end <= begin) {  // the whole tile lies after this row's position, or before its window
        std::fill(s, s + KEY_TILE, 0.0f);
        rescale[r] = 1.0f;
        continue;
      }
      std::fill(s, s + begin, NEG_INF);
      std::fill(s + end, s + KEY_TILE, NEG_INF);
#if defined(__AVX512F__)
      const float tile_max = _mm512_reduce_max_ps(_mm512_loadu_ps(s));
#else
      const float tile_max = *std::max_element(s + begin, s + end);
#endif
      const float peak = std::max(max[r], tile_max);
      rescale[r] = max[r] == NEG_INF ? 0.0f : std::exp(max[r] - peak);
      max[r] = peak;
      sum[r] = sum[r] * rescale[r] + exp_shifted_sum(s, s, KEY_TILE, peak);
    }
  }

  template <typename T>
  void accumulate(const T* vals, int64_t stride, int64_t n) {
#if defined(__AVX512F__)
    if constexpr (!std::is_same_v<T, double>) {
      switch (head_dim) {
        case 64: return accumulate_all<4>(acc.data(), rescale.data(), scores.data(), vals, stride, n, rows);
        case 128: return accumulate_all<8>(acc.data(), rescale.data(), scores.data(), vals, stride, n, rows);
        default: break;
      }
    }
#endif
    values.resize(n * head_dim);
    for (int64_t t = 0; t < n; ++t) to_float(values.data() + t * head_dim, vals + t * stride, head_dim);
    for (int64_t r = 0; r < rows; ++r) {
      float* a = acc.data() + r * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] *= rescale[r];
      for (int64_t t = 0; t < n; ++t) {
        const float w = scores[r * KEY_TILE + t];
        const float* v = values.data() + t * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) a[d] += w * v[d];
      }
    }
  }
};

void check_heads(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              " must be a CPU [tokens, heads, head_dim] tensor with contiguous heads");
}

void check_cache(const torch::Tensor& c, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(c.is_contiguous() && c.dim() == 4, name,
              " must be a contiguous [blocks, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(c.size(2) == like.size(1) && c.size(3) == like.size(2), name, " does not match the K/V head shape");
}

bool is_quantized(at::ScalarType t) { return t == at::kChar || t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// Per KV head: the cache's scale (1 for an unquantized cache).
std::vector<float> head_scales(const c10::optional<torch::Tensor>& given, bool quantized, int64_t kv_heads,
                               const char* name) {
  if (!quantized) return std::vector<float>(kv_heads, 1.0f);
  TORCH_CHECK(
      given.has_value() && given->scalar_type() == at::kFloat && given->is_contiguous() && given->numel() == kv_heads,
      name, " must be a contiguous float32 tensor with one scale per KV head for a quantized cache");
  const float* p = given->data_ptr<float>();
  return std::vector<float>(p, p + kv_heads);
}

// Stores x / scale as the cache's code, as the PyTorch path does (kv_quant.py): clamped to the
// type's largest finite value, then rounded half to even (int8) or converted (fp8).
template <typename In>
void quantize_row(uint8_t* dst, const In* src, int64_t n, float scale, at::ScalarType type) {
  for (int64_t i = 0; i < n; ++i) {
    const float y = static_cast<float>(src[i]) / scale;
    if (type == at::kChar) {
      dst[i] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(std::clamp(y, -127.0f, 127.0f))));
    } else if (type == at::kFloat8_e4m3fn) {
      dst[i] = c10::Float8_e4m3fn(std::clamp(y, -448.0f, 448.0f)).x;
    } else {
      dst[i] = c10::Float8_e5m2(std::clamp(y, -57344.0f, 57344.0f)).x;
    }
  }
}

}  // namespace

void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor k_cache, torch::Tensor v_cache,
              const torch::Tensor& slots, const c10::optional<torch::Tensor>& k_scale,
              const c10::optional<torch::Tensor>& v_scale) {
  RECORD_FUNCTION("native::write_kv", c10::ArrayRef<const c10::IValue>{});
  check_heads(k, "k");
  check_heads(v, "v");
  check_cache(k_cache, k, "k_cache");
  check_cache(v_cache, v, "v_cache");
  const at::ScalarType cache_type = k_cache.scalar_type();
  const bool quantized = is_quantized(cache_type);
  TORCH_CHECK(v_cache.scalar_type() == cache_type && k.scalar_type() == v.scalar_type() &&
                  (quantized || cache_type == k.scalar_type()),
              "the caches' dtype must be K/V's, or int8 / float8_e4m3fn / float8_e5m2 with scales");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == at::kLong && slots.numel() == k.size(0));
  const int64_t tokens = k.size(0), row = k.size(1) * k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "cache slot out of range");
  if (quantized) {
    const int64_t kv_heads = k.size(1), head_dim = k.size(2);
    const std::vector<float> ks = head_scales(k_scale, true, kv_heads, "k_scale");
    const std::vector<float> vs = head_scales(v_scale, true, kv_heads, "v_scale");
    uint8_t* kc = static_cast<uint8_t*>(k_cache.data_ptr());
    uint8_t* vc = static_cast<uint8_t*>(v_cache.data_ptr());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
      const scalar_t* kp = k.data_ptr<scalar_t>();
      const scalar_t* vp = v.data_ptr<scalar_t>();
      at::parallel_for(0, tokens * kv_heads, 64, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t t = i / kv_heads, h = i % kv_heads, at = sp[t] * row + h * head_dim;
          quantize_row(kc + at, kp + t * k.stride(0) + h * head_dim, head_dim, ks[h], cache_type);
          quantize_row(vc + at, vp + t * v.stride(0) + h * head_dim, head_dim, vs[h], cache_type);
        }
      });
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "write_kv", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      std::copy_n(kp + t * k.stride(0), row, kc + sp[t] * row);
      std::copy_n(vp + t * v.stride(0), row, vc + sp[t] * row);
    }
  });
}

// paged_attention in three stages. plan: checks the inputs and cuts the batch into work items
// from the shapes alone, before any arithmetic, so that how a row's result is computed never
// depends on the rest of the batch or on the thread count. run: the threads compute the items,
// in any order and independently (an item owns its rows); an item that covers its rows' whole
// context normalises straight into the output, one segment of a split context leaves its running
// max, sum and weighted values as a partial result. merge: the one place items meet, after all
// of them ran: each split context's partial results combined into its output rows.
namespace {

// Queries [first_query, first_query + queries) of a sequence, over positions [pos_begin, pos_end)
// of its context, for KV heads [head_begin, head_end). Its partial results (one per head and row)
// start at `partial`; -1: the item covers the whole context and writes the output.
struct WorkItem {
  int64_t seq, first_query, queries, pos_begin, pos_end, partial;
  int64_t head_begin, head_end;  // all KV heads, unless the batch is too small to share otherwise
};

// A span of queries whose context was split: its segments' partial results, to merge.
struct SplitSpan {
  int64_t seq, first_query, queries, first_partial, segments;
};

// Positions per segment of a long context (a multiple of KEY_TILE: segments start on a key tile).
constexpr int64_t SEGMENT = 512;
// How far ahead (positions) a work item asks for K/V rows: one tile.
constexpr int64_t PREFETCH_DISTANCE = KEY_TILE;

// A software prefetch of a K/V line towards L2 (prefetcht2). Contexts come from DRAM. Asking for
// the next tile one KV head at a time, just before computing the same head of this tile, into L2
// rather than L1 (where lines evicted the tile being computed), made a 64-decode step's attention
// ~2.5x faster than T0 hints for the whole tile at once (which overflowed the outstanding-miss
// queue: most were dropped). Inline assembly because GCC 12 deleted a loop of __builtin_prefetch /
// _mm_prefetch calls here (it counts prefetches as having no effect).
inline void prefetch_to_l2(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht2 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 1);
#endif
}

struct AttentionPlan {
  int64_t num_heads = 0, head_dim = 0, group = 1, kv_heads = 0, block_size = 0, table_width = 0;
  int64_t window = 0;                     // sliding window (positions a query sees, its own included); 0: none
  std::vector<float> k_scales, v_scales;  // per KV head (1 for an unquantized cache)
  std::vector<WorkItem> items;
  std::vector<int64_t> order;  // item indices, heaviest first: the order threads take them in
  int64_t workers = 0;         // threads that take part
  std::vector<SplitSpan> splits;
  int64_t partial_rows = 0;  // one per (split segment, query head, query)

  // Offset in q or out (rows `token_stride` apart) of row r of KV head h for the queries that
  // start at batch row `first`: row r = (query j, group member g) with r = j * group + g, query
  // head h * group + g.
  int64_t head_row(int64_t token_stride, int64_t first, int64_t h, int64_t r) const {
    return (first + r / group) * token_stride + (h * group + r % group) * head_dim;
  }
};

// The split segments' results, one per (segment, query head, query): running max, sum, then
// head_dim weighted values (the value scale applied).
struct Partials {
  int64_t head_dim;
  std::vector<float> data;
  Partials(int64_t rows, int64_t d) : head_dim(d), data(rows * (d + 2)) {}
  float* row(int64_t index) { return data.data() + index * (head_dim + 2); }
  const float* row(int64_t index) const { return data.data() + index * (head_dim + 2); }
};

AttentionPlan plan_attention(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                             const torch::Tensor& seq_info, const c10::optional<torch::Tensor>& k_scale,
                             const c10::optional<torch::Tensor>& v_scale, int64_t window) {
  // q, out: [tokens, heads, head_dim]. seq_info: int32 [seqs, 3] = (first query row, number of
  // queries, position of the first query); query j of a sequence sits at position start + j and
  // sees positions 0 .. start + j, or with a window only start + j - window + 1 .. start + j.
  // block_tables: int32 [seqs, max_blocks].
  check_heads(q, "q");
  check_heads(out, "out");
  TORCH_CHECK(
      k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
      "caches must be contiguous [blocks, block_size, kv_heads, head_dim] tensors");
  const at::ScalarType cache_type = k_cache.scalar_type();
  const bool quantized = is_quantized(cache_type);
  TORCH_CHECK(
      v_cache.scalar_type() == cache_type && out.scalar_type() == q.scalar_type() &&
          (quantized || cache_type == q.scalar_type()),
      "q and out must share a dtype, and the caches too: q's, or int8 / float8_e4m3fn / float8_e5m2 with scales");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt && block_tables.dim() == 2);
  TORCH_CHECK(seq_info.is_contiguous() && seq_info.scalar_type() == at::kInt && seq_info.dim() == 2 &&
              seq_info.size(1) == 3 && seq_info.size(0) == block_tables.size(0));
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  AttentionPlan plan;
  plan.window = window;
  plan.num_heads = q.size(1), plan.head_dim = q.size(2);
  plan.block_size = k_cache.size(1), plan.kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == plan.head_dim && plan.num_heads % plan.kv_heads == 0,
              "head shapes of q and the cache disagree");
  plan.group = plan.num_heads / plan.kv_heads, plan.table_width = block_tables.size(1);
  plan.k_scales = head_scales(k_scale, quantized, plan.kv_heads, "k_scale");
  plan.v_scales = head_scales(v_scale, quantized, plan.kv_heads, "v_scale");
  const int64_t seqs = seq_info.size(0), width = plan.table_width, block_size = plan.block_size;
  const int64_t num_blocks = k_cache.size(0);
  const int32_t* info = seq_info.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  // A tile of queries shares every key and value it reads; its rows are bounded by MAX_ROWS.
  const int64_t tile_queries = std::max<int64_t>(1, MAX_ROWS / plan.group);
  // A span's queries see positions [begin, context): begin is where the first query's window starts.
  struct Span {
    int64_t seq, first_query, queries, begin, context;
  };
  std::vector<Span> spans;
  for (int64_t b = 0; b < seqs; ++b) {
    const int64_t first = info[3 * b], count = info[3 * b + 1], start = info[3 * b + 2];
    TORCH_CHECK(count >= 1 && first >= 0 && first + count <= q.size(0) && first + count <= out.size(0),
                "query rows out of range");
    TORCH_CHECK(start >= 0 && (start + count + block_size - 1) / block_size <= width,
                "block table too short for the context");
    // Blocks wholly before every query's window are never read (nor checked: a table may free them).
    const int64_t first_block = window > 0 ? std::max<int64_t>(0, start - window + 1) / block_size : 0;
    for (int64_t i = first_block; i < (start + count + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tables[b * width + i] >= 0 && tables[b * width + i] < num_blocks, "block id out of range");
    for (int64_t j = 0; j < count; j += tile_queries) {
      const int64_t n = std::min(tile_queries, count - j);
      spans.push_back({b, j, n, window > 0 ? std::max<int64_t>(0, start + j - window + 1) : 0, start + j + n});
    }
  }
  // A context longer than SEGMENT is cut at the multiples of SEGMENT, and its rows merge their
  // segments' partial results; a shorter one is computed in one piece, which gives the bits a
  // merge of its one segment would. So a row's result depends only on its own position: not on
  // the other rows of its tile (the chunking of its prompt), the batch, or the thread count. A
  // batch of fewer than two pieces per thread (a single decode) gives each KV head its own item:
  // heads are independent, so that changes no result either.
  // With a window, segments wholly before the span's first window are skipped, and the first one
  // starts at the block holding the window's start: its key tiles are those of the whole segment
  // (tiles never cross a block), less tiles no row sees, which change no row's sums (softmax_update).
  // A row's segments that it sees at all are the same whatever shares its span; one it does not
  // see merges as nothing (its max is -inf).
  struct Segment {
    int64_t span, pos_begin, pos_end, partial;
  };
  std::vector<Segment> segments;
  for (int64_t i = 0; i < static_cast<int64_t>(spans.size()); ++i) {
    const Span& sp = spans[i];
    const int64_t first_segment = sp.begin / SEGMENT * SEGMENT;
    const int64_t count = (sp.context - first_segment + SEGMENT - 1) / SEGMENT;
    if (count > 1) plan.splits.push_back({sp.seq, sp.first_query, sp.queries, plan.partial_rows, count});
    for (int64_t p = first_segment; p < sp.context; p += SEGMENT) {
      const int64_t from = std::max(p, sp.begin / block_size * block_size);
      segments.push_back({i, from, std::min(sp.context, p + SEGMENT), count > 1 ? plan.partial_rows : -1});
      if (count > 1) plan.partial_rows += sp.queries * plan.num_heads;
    }
  }
  const int64_t threads = at::get_num_threads();
  const int64_t heads_per_item = static_cast<int64_t>(segments.size()) >= 2 * threads ? plan.kv_heads : 1;
  std::vector<int64_t> costs;
  for (const Segment& seg : segments) {
    const Span& sp = spans[seg.span];
    for (int64_t h = 0; h < plan.kv_heads; h += heads_per_item) {
      plan.items.push_back(
          {sp.seq, sp.first_query, sp.queries, seg.pos_begin, seg.pos_end, seg.partial, h, h + heads_per_item});
      costs.push_back(sp.queries * (seg.pos_end - seg.pos_begin) * heads_per_item);
    }
  }
  // Items differ a lot in cost: taken heaviest first, the last ones to finish are short.
  plan.order.resize(plan.items.size());
  std::iota(plan.order.begin(), plan.order.end(), 0);
  std::stable_sort(plan.order.begin(), plan.order.end(), [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  plan.workers = std::min<int64_t>(threads, static_cast<int64_t>(plan.items.size()));
  return plan;
}

// Computes every item of the plan, the threads taking them in plan order from a shared counter.
template <typename scalar_t, typename cache_t>
void run_attention(const AttentionPlan& plan, torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                   const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_info,
                   double scale, Partials& partials) {
  const int64_t head_dim = plan.head_dim, group = plan.group, kv_heads = plan.kv_heads;
  const int64_t block_size = plan.block_size, width = plan.table_width;
  const int32_t* info = seq_info.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const cache_t* kc = static_cast<const cache_t*>(k_cache.data_ptr());
  const cache_t* vc = static_cast<const cache_t*>(v_cache.data_ptr());
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t slot_stride = kv_heads * head_dim;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, plan.workers, 1, [&](int64_t, int64_t) {
    std::vector<Tile> heads(kv_heads);
    std::vector<int64_t> row_last;
    // Position `pos` of sequence `seq`: the offset of its K/V row (all heads) in the caches.
    const auto row_of = [&](int64_t seq, int64_t pos) {
      return (static_cast<int64_t>(tables[seq * width + pos / block_size]) * block_size + pos % block_size) *
             slot_stride;
    };
    // Asks for the K/V rows of positions [pos, pos + n) of an item, KV heads [head_begin,
    // head_end), ahead of their use.
    const auto prefetch = [&](const WorkItem& it, int64_t pos, int64_t n, int64_t head_begin, int64_t head_end) {
      const int64_t first_byte = head_begin * head_dim * sizeof(cache_t);
      const int64_t last_byte = head_end * head_dim * sizeof(cache_t);
      const int64_t end = std::min(pos + n, it.pos_end);
      for (int64_t p = pos; p < end; ++p) {
        const int64_t row = row_of(it.seq, p);
        const char* k_row = reinterpret_cast<const char*>(kc + row);
        const char* v_row = reinterpret_cast<const char*>(vc + row);
        for (int64_t byte = first_byte; byte < last_byte; byte += 64) {
          prefetch_to_l2(k_row + byte);
          prefetch_to_l2(v_row + byte);
        }
      }
    };
    const int64_t num_items = static_cast<int64_t>(plan.items.size());
    for (int64_t index = next.fetch_add(1); index < num_items;) {
      const WorkItem& it = plan.items[plan.order[index]];
      // The thread's next item is taken now, so that its first tiles load while this one computes.
      index = next.fetch_add(1);
      if (index < num_items) {
        const WorkItem& upcoming = plan.items[plan.order[index]];
        prefetch(upcoming, upcoming.pos_begin, PREFETCH_DISTANCE, upcoming.head_begin, upcoming.head_end);
      }
      const int64_t first = info[3 * it.seq] + it.first_query, start = info[3 * it.seq + 2] + it.first_query;
      const int64_t rows = it.queries * group;
      row_last.resize(rows);
      for (int64_t r = 0; r < rows; ++r) row_last[r] = start + r / group;
      for (int64_t h = it.head_begin; h < it.head_end; ++h) {
        Tile& tile = heads[h];
        tile.reset<cache_t>(head_dim, rows, static_cast<float>(scale) * plan.k_scales[h], plan.window);
        for (int64_t r = 0; r < rows; ++r) tile.load_query(r, qp + plan.head_row(q.stride(0), first, h, r));
      }
      for (int64_t pos = it.pos_begin; pos < it.pos_end;) {
        const int64_t n = std::min({KEY_TILE, block_size - pos % block_size, it.pos_end - pos});
        const int64_t at = row_of(it.seq, pos);
        for (int64_t h = it.head_begin; h < it.head_end; ++h) {
          prefetch(it, pos + PREFETCH_DISTANCE, n, h, h + 1);
          heads[h].step(kc + at + h * head_dim, vc + at + h * head_dim, slot_stride, pos, n, row_last.data());
        }
        pos += n;
      }
      for (int64_t h = it.head_begin; h < it.head_end; ++h) {
        Tile& tile = heads[h];
        const float v_scale = plan.v_scales[h];
        for (int64_t r = 0; r < rows; ++r) {
          const float* acc = tile.finish_row(r);
          if (it.partial >= 0) {
            float* dst = partials.row(it.partial + h * rows + r);
            dst[0] = tile.max[r], dst[1] = tile.sum[r];
            for (int64_t d = 0; d < head_dim; ++d) dst[2 + d] = acc[d] * v_scale;
            continue;
          }
          // As merge_attention normalises (a row that sees one segment gets the same bits there).
          scalar_t* dst = op + plan.head_row(out.stride(0), first, h, r);
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[d] * v_scale / tile.sum[r]);
        }
      }
    }
  });
}

// Each split span's rows: its segments' partial results rescaled to their overall max, summed
// and normalised into the output.
template <typename scalar_t>
void merge_attention(const AttentionPlan& plan, torch::Tensor& out, const torch::Tensor& seq_info,
                     const Partials& partials) {
  const int64_t head_dim = plan.head_dim;
  const int32_t* info = seq_info.data_ptr<int32_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  std::vector<float> merged(head_dim);
  for (const SplitSpan& sp : plan.splits) {
    const int64_t rows = sp.queries * plan.group, first = info[3 * sp.seq] + sp.first_query;
    const auto part_at = [&](int64_t segment, int64_t row) {
      return partials.row(sp.first_partial + segment * sp.queries * plan.num_heads + row);
    };
    for (int64_t hr = 0; hr < plan.kv_heads * rows; ++hr) {
      float peak = NEG_INF;
      for (int64_t s = 0; s < sp.segments; ++s) peak = std::max(peak, part_at(s, hr)[0]);
      float total = 0;
      std::fill(merged.begin(), merged.end(), 0.0f);
      for (int64_t s = 0; s < sp.segments; ++s) {
        const float* part = part_at(s, hr);
        if (part[0] == NEG_INF) continue;  // no position of this segment is visible to the row
        const float w = std::exp(part[0] - peak);
        total += part[1] * w;
        for (int64_t d = 0; d < head_dim; ++d) merged[d] += part[2 + d] * w;
      }
      scalar_t* dst = op + plan.head_row(out.stride(0), first, hr / rows, hr % rows);
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(merged[d] / total);
    }
  }
}

template <typename T>
struct CacheType {
  using type = T;
};

}  // namespace

void paged_attention(torch::Tensor out, const torch::Tensor& q, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_info,
                     double scale, const c10::optional<torch::Tensor>& k_scale,
                     const c10::optional<torch::Tensor>& v_scale, int64_t window) {
  RECORD_FUNCTION("native::paged_attention", c10::ArrayRef<const c10::IValue>{});
  const AttentionPlan plan = plan_attention(out, q, k_cache, v_cache, block_tables, seq_info, k_scale, v_scale, window);
  Partials partials(plan.partial_rows, plan.head_dim);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const auto run_and_merge = [&](auto cache_tag) {
      using cache_t = typename decltype(cache_tag)::type;
      run_attention<scalar_t, cache_t>(plan, out, q, k_cache, v_cache, block_tables, seq_info, scale, partials);
      merge_attention<scalar_t>(plan, out, seq_info, partials);
    };
    switch (k_cache.scalar_type()) {
      case at::kChar: return run_and_merge(CacheType<KvInt8>{});
      case at::kFloat8_e4m3fn: return run_and_merge(CacheType<KvE4M3>{});
      case at::kFloat8_e5m2: return run_and_merge(CacheType<KvE5M2>{});
      default: return run_and_merge(CacheType<scalar_t>{});
    }
  });
}
