// LoRA adapters of one step on one wrapped linear (tachyllm/lora/layers.py), in segment form: the
// step's rows grouped by adapter, each adapter's A and B read once for all its rows.
//
// For one segment (the rows of one adapter) with A [R, in] (the stacked A of the projections that
// share the input: q/k/v, gate/up) and, per projection, scale * B transposed [r, cols]:
//   shrink  s[m, j] = x[m] . A[j]                     (fp32, for every row m and rank j < R)
//   expand  out[m, c] = round(out[m, c] + sum_j s[m, r0 + j] * Bt[j, c])   over the projection's ranks
// Both in fp32 whatever the activations (bf16 or fp32) and the stored weights (fp32, or bf16 for bf16
// activations: widened to fp32 as they are loaded); out is rounded once, as the PyTorch path rounds.
// Each output is summed in one order fixed by the build (dot products: 16 fp32 lanes, then the lanes;
// expands: ranks in order), whatever the other rows of the call and the threads: a row's result does
// not depend on the batch (batch invariance, docs/determinism.md).
//
// The rows' shrunk vectors are small ([rows, R] fp32); the shrink's threads take rows (or, for one row,
// ranks), the expand's take column ranges, so one decode row still spreads over the threads; all the
// segments of a call share those two parallel regions. AVX-512 where the build
// has it; a scalar loop of the same order elsewhere.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "lora.h"
#include "ops.h"
#include "vec_math.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;

// The least columns of an expand and ranks of a one-row shrink a thread takes, so that the default
// model's smallest ones (576 columns, 16 ranks) still go to two threads (not tuned).
constexpr int64_t kExpandGrain = 256;
constexpr int64_t kShrinkGrain = 8;

template <typename T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

// One row of activations widened to fp32.
template <typename T>
void widen(float* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

// x . a over n, for fp32 x and a row of A in fp32 (vec_math.h's dot) or bf16, in the same order:
// 16 fp32 lanes, then the lanes, then the tail.
inline float dot_row(const float* x, const float* a, int64_t n) { return dot(x, a, n); }
inline float dot_row(const float* x, const bf16* a, int64_t n) {
  int64_t i = 0;
  float sum = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 w = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + i))), 16));
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), w, acc);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += x[i] * static_cast<float>(a[i]);
  return sum;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
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

// out[rows[i], c0 + c] for c in [begin, end) += shrunk[i] . Bt[:, c] over `rank` ranks, for R rows
// at once: each load of Bt serves every row, and each row's sum runs over the ranks in order from
// zero, as it would alone (R = 1), so the bits do not depend on the tile.
template <int R, typename T, typename W>
void expand_rows(T* const* out_rows, const float* const* shrunk, const W* bt, int64_t cols, int64_t rank, int64_t begin,
                 int64_t end) {
  int64_t c = begin;
#if defined(__AVX512F__)
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

constexpr int kExpandRows = 4;  // rows per tile of the expand: 4 accumulators and one load per rank

// One segment of a call: its rows (None: the call's rows 0..count) and its adapter's weights (W: their
// stored dtype).
template <typename W>
struct Segment {
  const int64_t* rows;
  int64_t count;
  int64_t first;  // its first row among the call's segments' rows, in order (its rows of `shrunk`)
  const W* a;
  int64_t ranks;
  const W* bt;
  const int64_t* layout;
  int64_t parts;
};

// Every segment of the call in two parallel regions (a region costs a thread wake-up, which a decode
// step pays per linear): the shrink of every row, then the expand of every column range.
template <typename T, typename W>
void apply_segments(T* out, int64_t out_stride, int64_t out_cols, const T* x, int64_t x_stride, int64_t in,
                    const std::vector<Segment<W>>& segments, int64_t total_rows, int64_t max_ranks) {
  std::vector<float> shrunk(total_rows * max_ranks);
  std::vector<int64_t> segment_of(total_rows);
  for (size_t s = 0; s < segments.size(); ++s)
    for (int64_t m = 0; m < segments[s].count; ++m) segment_of[segments[s].first + m] = static_cast<int64_t>(s);
  auto row_of = [&](const Segment<W>& seg, int64_t m) { return seg.rows ? seg.rows[m] : m; };

  // The shrink: a thread takes rows (each widened to fp32 once, A staying in cache), or for one row
  // ranks; every s[m, j] is the same dot product either way.
  if (total_rows == 1) {
    const Segment<W>& seg = segments[0];
    std::vector<float> xs(in);
    widen(xs.data(), x + row_of(seg, 0) * x_stride, in);
    at::parallel_for(0, seg.ranks, kShrinkGrain, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) shrunk[j] = dot_row(xs.data(), seg.a + j * in, in);
    });
  } else {
    at::parallel_for(0, total_rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> xs(in);
      for (int64_t g = begin; g < end; ++g) {
        const Segment<W>& seg = segments[segment_of[g]];
        widen(xs.data(), x + row_of(seg, g - seg.first) * x_stride, in);
        for (int64_t j = 0; j < seg.ranks; ++j) shrunk[g * max_ranks + j] = dot_row(xs.data(), seg.a + j * in, in);
      }
    });
  }
  // The expand: a thread takes a range of output columns, for every segment's projections there; each
  // projection's scale * B^T follows the previous one's in bt.
  at::parallel_for(0, out_cols, kExpandGrain, [&](int64_t begin, int64_t end) {
    for (const Segment<W>& seg : segments) {
      int64_t bt_offset = 0;
      for (int64_t p = 0; p < seg.parts; ++p) {
        const int64_t* lay = seg.layout + 4 * p;
        const int64_t col0 = lay[0], cols = lay[1], rank0 = lay[2], rank = lay[3];
        const int64_t from = std::max(begin, col0), to = std::min(end, col0 + cols);
        T* rows[kExpandRows];
        const float* sums[kExpandRows];
        for (int64_t m = 0; from < to && m < seg.count; m += kExpandRows) {
          const int64_t n = std::min<int64_t>(kExpandRows, seg.count - m);
          for (int64_t i = 0; i < n; ++i) {
            rows[i] = out + row_of(seg, m + i) * out_stride + col0;
            sums[i] = shrunk.data() + (seg.first + m + i) * max_ranks + rank0;
          }
          const W* proj_bt = seg.bt + bt_offset;
          if (n == kExpandRows)
            expand_rows<kExpandRows>(rows, sums, proj_bt, cols, rank, from - col0, to - col0);
          else
            for (int64_t i = 0; i < n; ++i)
              expand_rows<1>(rows + i, sums + i, proj_bt, cols, rank, from - col0, to - col0);
        }
        bt_offset += rank * cols;
      }
    }
  });
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

void LoRASlots::set(int64_t slot, const torch::Tensor& a, const torch::Tensor& bt, const torch::Tensor& layout) {
  TORCH_CHECK(slot >= 0, "a slot is a non-negative index");
  TORCH_CHECK((a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16) && a.dim() == 2 && a.is_contiguous(),
              "A must be contiguous fp32 or bf16 [ranks, in]");
  TORCH_CHECK(bt.scalar_type() == a.scalar_type() && bt.dim() == 1 && bt.is_contiguous(),
              "Bt must be contiguous flat, in A's dtype");
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
  slots_[slot] = Weights{a, bt, layout};
}

void LoRASlots::clear(int64_t slot) {
  if (slot >= 0 && slot < static_cast<int64_t>(slots_.size())) slots_[slot] = c10::nullopt;
}

void LoRASlots::apply(torch::Tensor out, const torch::Tensor& x, const LoRAStep& step) const {
  RECORD_FUNCTION("native::lora_apply", std::vector<c10::IValue>());
  if (step.slots.empty()) return;
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "x [rows, in] and out [rows, out] expected");
  TORCH_CHECK(x.scalar_type() == out.scalar_type(), "x and out must have one dtype");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              "LoRA activations must be bf16 or fp32, got ", x.scalar_type());
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1, "x and out rows must be contiguous");
  const int64_t* row_index = step.rows ? step.rows->data_ptr<int64_t>() : nullptr;
  if (row_index) {
    for (int64_t m = 0; m < step.rows->numel(); ++m)
      TORCH_CHECK(row_index[m] >= 0 && row_index[m] < x.size(0), "a row index is out of range");
  } else {
    TORCH_CHECK(step.offsets[1] == x.size(0), "the step's one segment must hold every row");
  }
  // The adapters of the step here: (its first segment's begin, count, slot's weights); one weight dtype.
  struct Found {
    int64_t begin, count, first;
    const Weights* w;
  };
  std::vector<Found> found;
  int64_t total_rows = 0, max_ranks = 0;
  for (size_t s = 0; s < step.slots.size(); ++s) {
    const int64_t slot = step.slots[s], begin = step.offsets[s], count = step.offsets[s + 1] - begin;
    if (count == 0 || slot < 0 || slot >= static_cast<int64_t>(slots_.size()) || !slots_[slot]) continue;
    const Weights& w = *slots_[slot];
    TORCH_CHECK(w.a.size(1) == x.size(1), "the adapter's A has ", w.a.size(1), " input features, x ", x.size(1));
    TORCH_CHECK(w.a.scalar_type() == at::kFloat || w.a.scalar_type() == x.scalar_type(),
                "bf16 adapter weights need bf16 activations");
    TORCH_CHECK(found.empty() || w.a.scalar_type() == found[0].w->a.scalar_type(),
                "the adapters of one linear must share one weight dtype");
    const int64_t* lay = w.layout.data_ptr<int64_t>();
    for (int64_t p = 0; p < w.layout.size(0); ++p)
      TORCH_CHECK(lay[4 * p] + lay[4 * p + 1] <= out.size(1), "a projection's columns exceed out");
    found.push_back(Found{begin, count, total_rows, &w});
    total_rows += count;
    max_ranks = std::max(max_ranks, w.a.size(0));
  }
  if (found.empty()) return;
  auto segments_of = [&](auto tag) {
    using W = decltype(tag);
    std::vector<Segment<W>> segments;
    for (const Found& f : found)
      segments.push_back(Segment<W>{row_index ? row_index + f.begin : nullptr, f.count, f.first,
                                    f.w->a.template data_ptr<W>(), f.w->a.size(0), f.w->bt.template data_ptr<W>(),
                                    f.w->layout.template data_ptr<int64_t>(), f.w->layout.size(0)});
    return segments;
  };
  const bool bf16_weights = found[0].w->a.scalar_type() == at::kBFloat16;
  if (x.scalar_type() == at::kBFloat16) {
    if (bf16_weights)
      apply_segments(out.data_ptr<bf16>(), out.stride(0), out.size(1), x.data_ptr<bf16>(), x.stride(0), x.size(1),
                     segments_of(bf16{}), total_rows, max_ranks);
    else
      apply_segments(out.data_ptr<bf16>(), out.stride(0), out.size(1), x.data_ptr<bf16>(), x.stride(0), x.size(1),
                     segments_of(float{}), total_rows, max_ranks);
  } else {
    apply_segments(out.data_ptr<float>(), out.stride(0), out.size(1), x.data_ptr<float>(), x.stride(0), x.size(1),
                   segments_of(float{}), total_rows, max_ranks);
  }
}

void register_lora(pybind11::module_& m) {
  pybind11::class_<LoRAStep, std::shared_ptr<LoRAStep>>(m, "LoRAStep", "the step's rows grouped by adapter slot")
      .def(pybind11::init<>())
      .def("set", &LoRAStep::set, pybind11::arg("rows"), pybind11::arg("offsets"), pybind11::arg("slots"));
  pybind11::class_<LoRASlots, std::shared_ptr<LoRASlots>>(m, "LoRASlots", "the adapters loaded into one linear")
      .def(pybind11::init<>())
      .def("set", &LoRASlots::set, pybind11::arg("slot"), pybind11::arg("a"), pybind11::arg("bt"),
           pybind11::arg("layout"))
      .def("clear", &LoRASlots::clear, pybind11::arg("slot"))
      .def("apply", &LoRASlots::apply,
           "out[rows] += scale * (x[rows] A^T) B^T per adapter segment of the step, in place (fp32 accumulation)",
           pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("step"), ReleaseGil());
}
