// Paged KV cache writes and decode attention that read the cache's blocks in place.
//
// The eager path gathers each decode's whole context into a padded tensor every layer and runs
// two batched matmuls and a masked softmax over it; here each (decode, KV head) pair walks its
// block table once, with the query heads that share the KV head reading each key and value row
// together. Scores, softmax and sums are fp32 whatever the cache dtype.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace {


template <typename T>
inline void to_float(float* dst, const T* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#if defined(__AVX512F__)
inline void to_float(float* dst, const c10::BFloat16* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

void check_heads(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              " must be a CPU [tokens, heads, head_dim] tensor with contiguous heads");
}

void check_cache(const torch::Tensor& c, const torch::Tensor& like, const char* name) {
  TORCH_CHECK(c.is_contiguous() && c.dim() == 4, name, " must be a contiguous [blocks, block_size, kv_heads, head_dim] tensor");
  TORCH_CHECK(c.size(2) == like.size(1) && c.size(3) == like.size(2), name, " does not match the K/V head shape");
}

}  // namespace

void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor k_cache, torch::Tensor v_cache,
              const torch::Tensor& slots) {
  RECORD_FUNCTION("native::write_kv", c10::ArrayRef<const c10::IValue>{});
  check_heads(k, "k");
  check_heads(v, "v");
  check_cache(k_cache, k, "k_cache");
  check_cache(v_cache, v, "v_cache");
  TORCH_CHECK(k_cache.scalar_type() == k.scalar_type() && v_cache.scalar_type() == v.scalar_type() &&
              k.scalar_type() == v.scalar_type(), "the cache dtype must match K/V");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == at::kLong && slots.numel() == k.size(0));
  const int64_t tokens = k.size(0), row = k.size(1) * k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "cache slot out of range");
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

void decode_attention(torch::Tensor out, const torch::Tensor& q, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& decode_info,
                      double scale) {
  RECORD_FUNCTION("native::decode_attention", c10::ArrayRef<const c10::IValue>{});
  // q, out: [tokens, heads, head_dim]. decode_info: int32 [decodes, 3] = (first query row,
  // number of queries, position of the first query); query j of a decode sits at position
  // start + j and sees positions 0 .. start + j (speculative decoding verifies several queries).
  // block_tables: int32 [decodes, max_blocks].
  check_heads(q, "q");
  check_heads(out, "out");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [blocks, block_size, kv_heads, head_dim] tensors");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
              out.scalar_type() == q.scalar_type(), "q, out and the caches must share a dtype");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt && block_tables.dim() == 2);
  TORCH_CHECK(decode_info.is_contiguous() && decode_info.scalar_type() == at::kInt && decode_info.dim() == 2 &&
              decode_info.size(1) == 3 && decode_info.size(0) == block_tables.size(0));
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % kv_heads == 0, "head shapes of q and the cache disagree");
  const int64_t group = num_heads / kv_heads, decodes = decode_info.size(0), width = block_tables.size(1);
  const int64_t num_blocks = k_cache.size(0);
  const int32_t* info = decode_info.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < decodes; ++b) {
    const int64_t first = info[3 * b], count = info[3 * b + 1], start = info[3 * b + 2];
    TORCH_CHECK(count >= 1 && first >= 0 && first + count <= q.size(0) && first + count <= out.size(0), "decode rows out of range");
    TORCH_CHECK(start >= 0 && (start + count + block_size - 1) / block_size <= width, "block table too short for the context");
    for (int64_t i = 0; i < (start + count + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tables[b * width + i] >= 0 && tables[b * width + i] < num_blocks, "block id out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t slot_stride = kv_heads * head_dim;
    at::parallel_for(0, decodes * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> query, scores, acc, row(head_dim);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / kv_heads, h = item % kv_heads;
        const int64_t first = info[3 * b], count = info[3 * b + 1], start = info[3 * b + 2];
        const int64_t context = start + count, rows = count * group;
        const int32_t* table = tables + b * width;
        // Row r = (query j, group member g) with r = j * group + g; query head = h * group + g.
        query.resize(rows * head_dim);
        for (int64_t j = 0; j < count; ++j)
          for (int64_t g = 0; g < group; ++g) {
            const scalar_t* src = qp + (first + j) * q.stride(0) + (h * group + g) * head_dim;
            float* dst = query.data() + (j * group + g) * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * static_cast<float>(scale);
          }
        scores.assign(rows * context, -std::numeric_limits<float>::infinity());
        // Both passes walk the block table block by block: row t of block i is position
        // i * block_size + t, one slot_stride after the previous row.
        for (int64_t i = 0, t0 = 0; t0 < context; ++i, t0 += block_size) {
          const scalar_t* keys = kc + static_cast<int64_t>(table[i]) * block_size * slot_stride + h * head_dim;
          for (int64_t t = t0; t < std::min(context, t0 + block_size); ++t) {
            to_float(row.data(), keys + (t - t0) * slot_stride, head_dim);
            // Queries before position t cannot see it (only the last query sees the whole context).
            for (int64_t r = std::max<int64_t>(0, t - start) * group; r < rows; ++r)
              scores[r * context + t] = dot(query.data() + r * head_dim, row.data(), head_dim);
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* s = scores.data() + r * context;
          const int64_t visible = start + r / group + 1;
          const float peak = *std::max_element(s, s + visible);
          const float inv = 1.0f / exp_shifted_sum(s, s, visible, peak);
          for (int64_t t = 0; t < visible; ++t) s[t] *= inv;
        }
        acc.assign(rows * head_dim, 0.0f);
        for (int64_t i = 0, t0 = 0; t0 < context; ++i, t0 += block_size) {
          const scalar_t* values = vc + static_cast<int64_t>(table[i]) * block_size * slot_stride + h * head_dim;
          for (int64_t t = t0; t < std::min(context, t0 + block_size); ++t) {
            to_float(row.data(), values + (t - t0) * slot_stride, head_dim);
            for (int64_t r = std::max<int64_t>(0, t - start) * group; r < rows; ++r) {
              const float p = scores[r * context + t];
              float* a = acc.data() + r * head_dim;
              for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
            }
          }
        }
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t j = r / group, g = r % group;
          scalar_t* dst = op + (first + j) * out.stride(0) + (h * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[r * head_dim + d]);
        }
      }
    });
  });
}
