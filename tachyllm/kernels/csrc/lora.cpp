// LoRA adapters of one step on one wrapped linear (tachyllm/lora/layers.py), in segment form: the
// step's rows grouped by adapter, each adapter's A and B read once for all its rows.
//
// For one segment (the rows of one adapter) with A [R, in] (the stacked A of the projections that
// share the input: q/k/v, gate/up) and, per projection, scale * B transposed [r, cols]:
//   shrink  s[m, j] = x[m] . A[j]                     (fp32, for every row m and rank j < R)
//   expand  out[m, c] = round(out[m, c] + sum_j s[m, r0 + j] * Bt[j, c])   over the projection's ranks
// Both in fp32 whatever the activations (bf16 or fp32) and the stored weights (fp32; bf16 for bf16
// activations; or int8 with a scale per rank, multiplied into s: widened to fp32 as they are loaded);
// out is rounded once, as the PyTorch path rounds.
// Each output is summed in one order fixed by the build (dot products: 16 fp32 lanes, then the lanes;
// expands: ranks in order), whatever the other rows of the call and the threads: a row's result does
// not depend on the batch (batch invariance, docs/determinism.md).
//
// A call of several rows runs in one parallel region (a region costs a thread wake-up, which a step
// pays per linear): each thread shrinks its share of (rows, ranks), a barrier, then each expands its
// range of output columns for every segment; a call of one row runs on the calling thread. The shrink computes several
// dot products at once (independent accumulators: one FMA chain per dot product is latency bound) from the activations
// as they are, without a widened copy; the expand several column chunks or rows at once for the same reason.
// Measurements: docs/design_measurements.md#lora-kernel. AVX-512 where the build has it; a scalar loop
// of the same order elsewhere.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "lora.h"
#include "ops.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

// Calls of up to kSerialRows rows run on the calling thread; larger ones split over up to one thread
// per kExpandGrain output columns times rows (not tuned).
constexpr int64_t kSerialRows = 1;
constexpr int64_t kExpandGrain = 256;
// A shrink work item: up to kShrinkRows rows of one segment by up to kShrinkRanks ranks. One row takes
// 8 ranks at once (8 independent FMA chains), more rows 4 ranks at a time (4 x 4 accumulators, each
// load of A serving 4 rows).
constexpr int64_t kShrinkRows = 4;
constexpr int64_t kShrinkRanks = 8;
constexpr int64_t kExpandRows = 4;  // rows per tile of the expand: each load of Bt serves 4 rows

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 load16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
// Rounded to nearest even as c10::BFloat16 does (NaN kept as a quiet NaN).
inline void store16(bf16* p, __m512 v, __mmask16 m) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lowest_kept, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(rounded));
}
#endif

// s[i][k0 + k] = x[i] . A[k] over n, for R rows and K ranks (A's rows n apart), each summed as one dot
// product alone would be: 16 fp32 lanes over the whole 16-wide chunks, then the lanes, then the tail
// in order, by explicit FMAs (a product and a sum left to the compiler might be fused in one tile's
// code and not in another's); bf16 values are widened exactly.
template <int R, int K, typename T, typename W>
void shrink_tile(const T* const* x, const W* a, int64_t n, float* const* s, int64_t k0, const float* scale) {
  int64_t i = 0;
  float sum[R][K] = {};
#if defined(__AVX512F__)
  __m512 acc[R][K];
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < K; ++k) acc[r][k] = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 w[K];
    for (int k = 0; k < K; ++k) w[k] = load16(a + k * n + i);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = load16(x[r] + i);
      for (int k = 0; k < K; ++k) acc[r][k] = _mm512_fmadd_ps(xv, w[k], acc[r][k]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < K; ++k) sum[r][k] = _mm512_reduce_add_ps(acc[r][k]);
#endif
  for (; i < n; ++i)
    for (int r = 0; r < R; ++r)
      for (int k = 0; k < K; ++k) sum[r][k] = std::fma(to_float(x[r][i]), to_float(a[k * n + i]), sum[r][k]);
  for (int r = 0; r < R; ++r)
    for (int k = 0; k < K; ++k) s[r][k0 + k] = scale ? sum[r][k] * scale[k0 + k] : sum[r][k];
}

// shrink_tile over `ranks` ranks for R rows: K ranks at a time, then one by one.
template <int R, int K, typename T, typename W>
void shrink_ranks(const T* const* x, const W* a, int64_t n, float* const* s, int64_t ranks, const float* scale) {
  int64_t k = 0;
  for (; k + K <= ranks; k += K) shrink_tile<R, K>(x, a + k * n, n, s, k, scale);
  for (; k < ranks; ++k) shrink_tile<R, 1>(x, a + k * n, n, s, k, scale);
}

// `scale`: int8 weights' scale of each rank (its A row's times its Bt row's), multiplied into the
// shrunk sums; null for fp32 / bf16 weights.
template <typename T, typename W>
void shrink_rows(int64_t rows, const T* const* x, const W* a, int64_t n, float* const* s, int64_t ranks,
                 const float* scale) {
  switch (rows) {
    case 4: return shrink_ranks<4, 4>(x, a, n, s, ranks, scale);
    case 3: return shrink_ranks<3, 4>(x, a, n, s, ranks, scale);
    case 2: return shrink_ranks<2, 4>(x, a, n, s, ranks, scale);
    default: return shrink_ranks<1, 8>(x, a, n, s, ranks, scale);
  }
}

// out[rows[i], c0 + c] for c in [begin, end) += shrunk[i] . Bt[:, c] over `rank` ranks, for R rows and
// C 16-column chunks at once (R * C accumulators; each load of Bt serves every row): each output's sum
// runs over the ranks in order from zero, as it would alone, so the bits do not depend on the tile.
template <int R, int C, typename T, typename W>
void expand_rows(T* const* out_rows, const float* const* shrunk, const W* bt, int64_t cols, int64_t rank, int64_t begin,
                 int64_t end) {
  int64_t c = begin;
#if defined(__AVX512F__)
  for (; c + 16 * C <= end; c += 16 * C) {
    __m512 acc[R][C];
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < C; ++h) acc[i][h] = _mm512_setzero_ps();
    for (int64_t j = 0; j < rank; ++j) {
      __m512 b[C];
      for (int h = 0; h < C; ++h) b[h] = load16(bt + j * cols + c + 16 * h);
      for (int i = 0; i < R; ++i) {
        const __m512 sj = _mm512_set1_ps(shrunk[i][j]);
        for (int h = 0; h < C; ++h) acc[i][h] = _mm512_fmadd_ps(sj, b[h], acc[i][h]);
      }
    }
    for (int i = 0; i < R; ++i)
      for (int h = 0; h < C; ++h) {
        T* o = out_rows[i] + c + 16 * h;
        store16(o, _mm512_add_ps(load16(o, 0xFFFF), acc[i][h]), 0xFFFF);
      }
  }
  for (; c < end; c += 16) {
    const __mmask16 m = end - c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (end - c)) - 1);
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < rank; ++j) {
      const __m512 b = load16(bt + j * cols + c, m);
      for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(shrunk[i][j]), b, acc[i]);
    }
    for (int i = 0; i < R; ++i) store16(out_rows[i] + c, _mm512_add_ps(load16(out_rows[i] + c, m), acc[i]), m);
  }
#endif
  for (; c < end; ++c) {
    for (int i = 0; i < R; ++i) {
      float acc = 0;
      for (int64_t j = 0; j < rank; ++j) acc = std::fma(shrunk[i][j], to_float(bt[j * cols + c]), acc);
      out_rows[i][c] = static_cast<T>(to_float(out_rows[i][c]) + acc);
    }
  }
}

// One segment of a call: its rows (None: the call's rows 0..count) and its adapter's weights, in
// their stored dtype (W of apply_segments).
struct Segment {
  const int64_t* rows;
  int64_t count;
  int64_t first;  // its first row among the call's segments' rows, in order (its rows of `shrunk`)
  const void* a;
  int64_t ranks;
  const void* bt;
  const int64_t* layout;
  int64_t parts;
  const float* scale;  // int8 weights: per rank; else null

  int64_t row(int64_t m) const { return rows ? rows[m] : m; }
  int64_t rank_chunks() const { return (ranks + kShrinkRanks - 1) / kShrinkRanks; }
  int64_t shrink_items() const { return (count + kShrinkRows - 1) / kShrinkRows * rank_chunks(); }
};

// The shrink's work items [first, last) of the call (each segment's row tiles by rank chunks, in
// order) into shrunk [rows, max_ranks].
template <typename T, typename W>
void shrink_items(const T* x, int64_t x_stride, int64_t in, const std::vector<Segment>& segments, float* shrunk,
                  int64_t max_ranks, int64_t first, int64_t last) {
  int64_t base = 0;
  for (const Segment& seg : segments) {
    const int64_t chunks = seg.rank_chunks(), end = base + seg.shrink_items();
    for (int64_t item = std::max(first, base); item < std::min(last, end); ++item) {
      const int64_t m0 = (item - base) / chunks * kShrinkRows, k0 = (item - base) % chunks * kShrinkRanks;
      const int64_t rows = std::min(kShrinkRows, seg.count - m0), ranks = std::min(kShrinkRanks, seg.ranks - k0);
      const T* xs[kShrinkRows];
      float* sums[kShrinkRows];
      for (int64_t i = 0; i < rows; ++i) {
        xs[i] = x + seg.row(m0 + i) * x_stride;
        sums[i] = shrunk + (seg.first + m0 + i) * max_ranks + k0;
      }
      shrink_rows(rows, xs, static_cast<const W*>(seg.a) + k0 * in, in, sums, ranks,
                  seg.scale ? seg.scale + k0 : nullptr);
    }
    base = end;
  }
}

// Every segment's projections over the output columns [begin, end), from the shrunk rows.
template <typename T, typename W>
void expand_columns(T* out, int64_t out_stride, const std::vector<Segment>& segments, const float* shrunk,
                    int64_t max_ranks, int64_t begin, int64_t end) {
  for (const Segment& seg : segments) {
    const W* bt = static_cast<const W*>(seg.bt);  // each projection's scale * B^T follows the previous one's
    for (int64_t p = 0; p < seg.parts; ++p) {
      const int64_t* lay = seg.layout + 4 * p;
      const int64_t col0 = lay[0], cols = lay[1], rank0 = lay[2], rank = lay[3];
      const int64_t from = std::max(begin, col0) - col0, to = std::min(end, col0 + cols) - col0;
      T* rows[kExpandRows];
      const float* sums[kExpandRows];
      for (int64_t m = 0; from < to && m < seg.count; m += kExpandRows) {
        const int64_t n = std::min<int64_t>(kExpandRows, seg.count - m);
        for (int64_t i = 0; i < n; ++i) {
          rows[i] = out + seg.row(m + i) * out_stride + col0;
          sums[i] = shrunk + (seg.first + m + i) * max_ranks + rank0;
        }
        if (n == kExpandRows)
          expand_rows<kExpandRows, 2>(rows, sums, bt, cols, rank, from, to);
        else
          for (int64_t i = 0; i < n; ++i) expand_rows<1, 4>(rows + i, sums + i, bt, cols, rank, from, to);
      }
      bt += rank * cols;
    }
  }
}

// Every segment of the call in one parallel region: each thread's share of the shrink's items, a
// barrier, then its share of the output columns (whole 16-column chunks).
template <typename T, typename W>
void apply_segments(T* out, int64_t out_stride, int64_t out_cols, const T* x, int64_t x_stride, int64_t in,
                    const std::vector<Segment>& segments, int64_t items, int64_t max_ranks, float* shrunk) {
  int64_t total_rows = 0;
  for (const Segment& seg : segments) total_rows += seg.count;
  const int64_t chunks = (out_cols + 15) / 16;
  auto shrink_share = [&](int64_t t, int64_t n) {
    shrink_items<T, W>(x, x_stride, in, segments, shrunk, max_ranks, items * t / n, items * (t + 1) / n);
  };
  auto expand_share = [&](int64_t t, int64_t n) {
    expand_columns<T, W>(out, out_stride, segments, shrunk, max_ranks, std::min(out_cols, chunks * t / n * 16),
                         std::min(out_cols, chunks * (t + 1) / n * 16));
  };
  // One row (a single stream's decode step) stays on the calling thread: its adapter bytes take about
  // as long to read as a region's wake-up and barrier cost (docs/design_measurements.md#lora-kernel).
  const int64_t threads =
      total_rows <= kSerialRows || at::in_parallel_region() || omp_in_parallel()
          ? 1
          : std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, total_rows * out_cols / kExpandGrain));
  if (threads <= 1) {
    shrink_share(0, 1);
    expand_share(0, 1);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    shrink_share(t, n);
#pragma omp barrier
    expand_share(t, n);
  }
}

}  // namespace

void LoRAStep::set(const c10::optional<torch::Tensor>& rows_, const std::vector<int64_t>& offsets_,
                   const std::vector<int64_t>& slots_) {
  TORCH_CHECK(offsets_.size() == (slots_.empty() ? 0 : slots_.size() + 1), "offsets must be one more than slots");
  for (size_t i = 0; i + 1 < offsets_.size(); ++i)
    TORCH_CHECK(offsets_[i] >= 0 && offsets_[i] <= offsets_[i + 1], "offsets must be ascending from 0");
  if (rows_) {
    TORCH_CHECK(rows_->scalar_type() == at::kLong && rows_->dim() == 1 && rows_->is_contiguous(),
                "rows must be contiguous int64");
    TORCH_CHECK(!offsets_.empty() && rows_->numel() == offsets_.back(), "the offsets must end at the number of rows");
  } else {
    TORCH_CHECK(slots_.size() <= 1 && (slots_.empty() || offsets_[0] == 0),
                "without rows, one segment holds every row");
  }
  rows = rows_;
  offsets = offsets_;
  slots = slots_;
}

void LoRASlots::set(int64_t slot, const torch::Tensor& a, const torch::Tensor& bt, const torch::Tensor& layout,
                    const c10::optional<torch::Tensor>& scale) {
  TORCH_CHECK(slot >= 0, "a slot is a non-negative index");
  const c10::ScalarType dtype = a.scalar_type();
  TORCH_CHECK(
      (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar) && a.dim() == 2 && a.is_contiguous(),
      "A must be contiguous fp32, bf16 or int8 [ranks, in]");
  TORCH_CHECK(bt.scalar_type() == dtype && bt.dim() == 1 && bt.is_contiguous(),
              "Bt must be contiguous flat, in A's dtype");
  if (dtype == at::kChar) {
    TORCH_CHECK(scale && scale->scalar_type() == at::kFloat && scale->dim() == 1 && scale->is_contiguous() &&
                    scale->numel() == a.size(0),
                "int8 weights need their fp32 scale per rank [ranks]");
  } else {
    TORCH_CHECK(!scale, "a scale goes with int8 weights only");
  }
  TORCH_CHECK(layout.scalar_type() == at::kLong && layout.dim() == 2 && layout.size(1) == 4 && layout.is_contiguous(),
              "a layout is int64 [projections, 4]");
  const int64_t* lay = layout.data_ptr<int64_t>();
  int64_t bt_size = 0;
  for (int64_t p = 0; p < layout.size(0); ++p) {
    TORCH_CHECK(lay[4 * p] >= 0 && lay[4 * p + 1] >= 0, "a projection's columns must be non-negative");
    TORCH_CHECK(lay[4 * p + 2] >= 0 && lay[4 * p + 3] >= 0 && lay[4 * p + 2] + lay[4 * p + 3] <= a.size(0),
                "a projection's ranks exceed A");
    bt_size += lay[4 * p + 1] * lay[4 * p + 3];
  }
  TORCH_CHECK(bt.numel() == bt_size, "Bt must hold each projection's [rank, columns] in turn");
  if (static_cast<int64_t>(slots_.size()) <= slot) slots_.resize(slot + 1);
  slots_[slot] = Weights{a, bt, layout, scale};
}

void LoRASlots::clear(int64_t slot) {
  if (slot >= 0 && slot < static_cast<int64_t>(slots_.size())) slots_[slot] = c10::nullopt;
}

namespace {

// The segments of a call of x's rows with weights in `slots` (LoRASlots' by slot), in the step's order,
// checked against x and an output of out_cols columns; one weight dtype. The scratch (segments, shrunk
// rows) is the calling thread's, reused from call to call: a decode step makes ~120 calls.
struct Call {
  const std::vector<Segment>& segments;
  c10::ScalarType weight_dtype;
  int64_t max_ranks;
  float* shrunk;  // [rows, max_ranks]
};

template <typename Slots>
Call prepare_call(const Slots& slots, const torch::Tensor& x, int64_t out_cols, const LoRAStep& step) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x [rows, in] with contiguous rows expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "LoRA activations must be bf16 or fp32, got ", x.scalar_type());
  const int64_t* row_index = step.rows ? step.rows->data_ptr<int64_t>() : nullptr;
  if (row_index) {
    for (int64_t m = 0; m < step.rows->numel(); ++m)
      TORCH_CHECK(row_index[m] >= 0 && row_index[m] < x.size(0), "a row index is out of range");
  } else {
    TORCH_CHECK(step.offsets[1] == x.size(0), "the step's one segment must hold every row");
  }
  thread_local std::vector<Segment> segments;
  thread_local std::vector<float> shrunk;
  segments.clear();
  c10::ScalarType weight_dtype = at::kFloat;
  int64_t total_rows = 0, max_ranks = 0;
  for (size_t s = 0; s < step.slots.size(); ++s) {
    const int64_t slot = step.slots[s], begin = step.offsets[s], count = step.offsets[s + 1] - begin;
    if (count == 0 || slot < 0 || slot >= static_cast<int64_t>(slots.size()) || !slots[slot]) continue;
    const auto& w = *slots[slot];
    TORCH_CHECK(w.a.size(1) == x.size(1), "the adapter's A has ", w.a.size(1), " input features, x ", x.size(1));
    TORCH_CHECK(w.a.scalar_type() != at::kBFloat16 || x.scalar_type() == at::kBFloat16,
                "bf16 adapter weights need bf16 activations");
    TORCH_CHECK(segments.empty() || w.a.scalar_type() == weight_dtype,
                "the adapters of one linear must share one weight dtype");
    const int64_t* lay = w.layout.template data_ptr<int64_t>();
    for (int64_t p = 0; p < w.layout.size(0); ++p)
      TORCH_CHECK(lay[4 * p] + lay[4 * p + 1] <= out_cols, "a projection's columns exceed out");
    weight_dtype = w.a.scalar_type();
    segments.push_back(Segment{row_index ? row_index + begin : nullptr, count, total_rows, w.a.data_ptr(), w.a.size(0),
                               w.bt.data_ptr(), lay, w.layout.size(0),
                               w.scale ? w.scale->template data_ptr<float>() : nullptr});
    total_rows += count;
    max_ranks = std::max(max_ranks, w.a.size(0));
  }
  if (static_cast<int64_t>(shrunk.size()) < total_rows * max_ranks) shrunk.resize(total_rows * max_ranks);
  return Call{segments, weight_dtype, max_ranks, shrunk.data()};
}

// fn(T{}, W{}) for activations of x_dtype and weights of w_dtype (bf16 weights only with bf16 activations).
template <typename Fn>
void with_dtypes(c10::ScalarType x_dtype, c10::ScalarType w_dtype, Fn&& fn) {
  if (x_dtype == at::kBFloat16) {
    if (w_dtype == at::kBFloat16)
      fn(bf16{}, bf16{});
    else if (w_dtype == at::kChar)
      fn(bf16{}, int8_t{});
    else
      fn(bf16{}, float{});
  } else if (w_dtype == at::kChar) {
    fn(float{}, int8_t{});
  } else {
    fn(float{}, float{});
  }
}

int64_t total_shrink_items(const std::vector<Segment>& segments) {
  int64_t items = 0;
  for (const Segment& seg : segments) items += seg.shrink_items();
  return items;
}

}  // namespace

void LoRASlots::apply(torch::Tensor out, const torch::Tensor& x, const LoRAStep& step) const {
  RECORD_FUNCTION("native::lora_apply", std::vector<c10::IValue>());
  if (step.slots.empty()) return;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0), "x [rows, in] and out [rows, out] expected");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "x and out must have one dtype");
  TORCH_CHECK(out.stride(1) == 1, "out rows must be contiguous");
  const Call call = prepare_call(slots_, x, out.size(1), step);
  if (call.segments.empty()) return;
  with_dtypes(x.scalar_type(), call.weight_dtype, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    apply_segments<T, W>(static_cast<T*>(out.data_ptr()), out.stride(0), out.size(1),
                         static_cast<const T*>(x.data_ptr()), x.stride(0), x.size(1), call.segments,
                         total_shrink_items(call.segments), call.max_ranks, call.shrunk);
  });
}

bool LoRASlots::epilogue(const torch::Tensor& x, int64_t out_features, const LoRAStep& step,
                         LinearEpilogue& epilogue) const {
  if (step.slots.empty()) return false;
  const Call call = prepare_call(slots_, x, out_features, step);
  if (call.segments.empty()) return false;
  with_dtypes(x.scalar_type(), call.weight_dtype, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    const T* xs = static_cast<const T*>(x.data_ptr());
    const int64_t x_stride = x.stride(0), in = x.size(1), items = total_shrink_items(call.segments);
    const std::vector<Segment>* segments = &call.segments;
    const int64_t max_ranks = call.max_ranks;
    float* shrunk = call.shrunk;
    epilogue.shared = [=](int64_t thread, int64_t threads) {
      shrink_items<T, W>(xs, x_stride, in, *segments, shrunk, max_ranks, items * thread / threads,
                         items * (thread + 1) / threads);
    };
    epilogue.columns = [=](void* out, int64_t begin, int64_t end) {
      expand_columns<T, W>(static_cast<T*>(out), out_features, *segments, shrunk, max_ranks, begin, end);
    };
  });
  return true;
}

void register_lora(pybind11::module_& m) {
  m.attr("LORA_INT8_WEIGHTS") = true;  // LoRASlots take int8 weights with a scale per rank
  pybind11::class_<LoRAStep, std::shared_ptr<LoRAStep>>(m, "LoRAStep", "the step's rows grouped by adapter slot")
      .def(pybind11::init<>())
      .def("set", &LoRAStep::set, pybind11::arg("rows"), pybind11::arg("offsets"), pybind11::arg("slots"));
  pybind11::class_<LoRASlots, std::shared_ptr<LoRASlots>>(m, "LoRASlots", "the adapters loaded into one linear")
      .def(pybind11::init<>())
      .def("set", &LoRASlots::set, pybind11::arg("slot"), pybind11::arg("a"), pybind11::arg("bt"),
           pybind11::arg("layout"), pybind11::arg("scale") = pybind11::none())
      .def("clear", &LoRASlots::clear, pybind11::arg("slot"))
      .def("apply", &LoRASlots::apply,
           "out[rows] += scale * (x[rows] A^T) B^T per adapter segment of the step, in place (fp32 accumulation)",
           pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("step"), ReleaseGil());
}
