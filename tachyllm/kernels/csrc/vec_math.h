// Small SIMD helpers shared by the kernels: a vectorised exp (the scalar std::exp cost more than
// the rest of softmax and SiLU together) and a dot product. AVX-512 where the build has it, plain
// loops otherwise.
#pragma once
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

// exp(x) = 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2; e^r by a degree-6 polynomial
// (relative error ~2e-7, like expf). Inputs below -87.3 give 0, as softmax wants for -inf.
inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.7f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512 result = _mm512_scalef_ps(p, n);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), result);
}
#endif

// dst[i] = exp(src[i] - shift) for i < n; returns the sum of dst.
inline float exp_shifted_sum(float* dst, const float* src, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(src + i), s));
    _mm512_storeu_ps(dst + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, src + i), s));
    _mm512_mask_storeu_ps(dst + i, m, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
    i = n;
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += (dst[i] = std::exp(src[i] - shift));
  return sum;
}

// dst[i] = x / (1 + exp(-x)) for x = src[i], i < n.
inline void silu(float* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_storeu_ps(dst + i, _mm512_div_ps(x, _mm512_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) dst[i] = src[i] / (1.0f + std::exp(-src[i]));
}

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}
