// LoRA adapters in segment form (lora.cpp): the step's rows grouped by adapter, and the adapters
// loaded into one wrapped linear. Shared by the wrapped linears (tachyllm/lora/layers.py) and the
// fused decoder layer (decode_layer.cpp), which apply them after each of their linears.
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "ops.h"

// The step's rows by adapter slot, set once per step: segment i holds the rows
// rows[offsets[i]:offsets[i + 1]] of slot slots[i]; without rows, one segment holds every row.
struct LoRAStep {
  c10::optional<torch::Tensor> rows;  // int64
  std::vector<int64_t> offsets;
  std::vector<int64_t> slots;

  void set(const c10::optional<torch::Tensor>& rows, const std::vector<int64_t>& offsets,
           const std::vector<int64_t>& slots);
};

// The adapters loaded into one linear, by slot: the stacked A [ranks, in]; Bt, each projection's
// scale * B^T [rank, cols] one after the other (flat), both fp32, both bf16 (for bf16 activations), or
// both int8 with an fp32 scale per rank (its A row's scale times its Bt row's: each projection's ranks
// are its own), one dtype for every slot of the linear; the layout int64 [projections, 4] of (first
// output column, columns, first rank, rank).
class LoRASlots {
 public:
  void set(int64_t slot, const torch::Tensor& a, const torch::Tensor& bt, const torch::Tensor& layout,
           const c10::optional<torch::Tensor>& scale);
  void clear(int64_t slot);
  // out[rows] += each segment's adapter update of x[rows], in place; slots without weights here are skipped.
  void apply(torch::Tensor out, const torch::Tensor& x, const LoRAStep& step) const;
  // apply() as work of the linear's own parallel region (quant_gemv_then), for an output of
  // out_features columns: the shrink shared by the threads, the expand on each thread's columns. False,
  // with `epilogue` untouched, where no segment of the step has weights here. The epilogue reads the
  // calling thread's scratch: run it before this thread's next call.
  bool epilogue(const torch::Tensor& x, int64_t out_features, const LoRAStep& step, LinearEpilogue& epilogue) const;

 private:
  struct Weights {
    torch::Tensor a, bt, layout;
    c10::optional<torch::Tensor> scale;
  };
  std::vector<c10::optional<Weights>> slots_;
};
