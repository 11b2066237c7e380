// The sum over the tensor-parallel ranks of one CPU host through a shared mapping
// (tachyllm/distributed/shm_allreduce.py maps it and calls this): gloo's all-reduce costs about a
// millisecond per call over loopback sockets, and a decode step makes two per layer.
//
// Mapping layout, for `size` ranks and slots of `slot_bytes` (a multiple of the cache line):
//   [0, size * kLine)  one uint64 per rank, each on its own cache line: the last sequence number
//                      the rank published (0 in a new, zero-filled mapping);
//   then 2 * size slots: slot (parity p, rank r) at size * kLine + (p * size + r) * slot_bytes.
//
// Call number s (every rank makes the same calls in the same order, from 1): rank r copies its
// tensor into slot (s % 2, r), then stores s into its flag with release order; it waits until every
// flag reads >= s with acquire order, which makes every peer's slot (s % 2, q) visible, and sums
// the slots of parity s % 2 in rank order into its tensor. Every rank thus computes the same sums
// in the same order and gets bitwise the same result (fp32 accumulation for bf16 / fp16, one
// rounding at the end).
//
// Why two buffers suffice: rank r writes slot (s % 2, r) for call s only after its call s - 1
// returned, which needed every peer's flag >= s - 1. A peer q publishes s - 1 only after its call
// s - 2 returned, i.e. after q's last read of the slots of parity (s - 2) % 2 = s % 2. The release
// store of q's flag orders those reads before it, and r's acquire load of that flag orders them
// before r's write, so r never overwrites what a peer still reads. Conversely a peer can be at most
// one call ahead (it cannot finish call s + 1 without r's flag reaching s + 1), so while r reads the
// slots of parity s % 2, the fastest peer writes parity (s + 1) % 2: hence "flag >= s", not "== s".
//
// The wait is bounded: a call spins (a pause instruction, then sched_yield, the host often having no
// core to spare for a spinning rank) until a deadline and returns false if a peer has not arrived;
// the caller then checks that the peers live and calls again.
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>

#include "ops.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLine = 64;
// Bytes (copy) or elements (sum) below which one thread does the work: a decode step's all-reduce
// is a few KiB, which a thread pool's wake-up would only slow down.
constexpr int64_t kCopyGrain = 256 * 1024;
constexpr int64_t kSumGrain = 64 * 1024;
// Elements summed together in fp32 registers / stack (the compiler vectorizes these loops).
constexpr int64_t kBlock = 64;
// Spinning on pause instructions for this long, then yielding the core between checks.
constexpr auto kSpinBeforeYield = std::chrono::microseconds(50);
// Flag checks between two readings of the clock.
constexpr int kChecksPerClockRead = 64;

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

template <typename T>
void sum_in_rank_order(T* out, const uint8_t* const* slots, int64_t size, int64_t n) {
  at::parallel_for(0, n, kSumGrain, [&](int64_t begin, int64_t end) {
    float acc[kBlock];
    for (int64_t first = begin; first < end; first += kBlock) {
      const int64_t count = std::min(kBlock, end - first);
      const T* s0 = reinterpret_cast<const T*>(slots[0]) + first;
      for (int64_t i = 0; i < count; ++i) acc[i] = static_cast<float>(s0[i]);
      for (int64_t r = 1; r < size; ++r) {
        const T* sr = reinterpret_cast<const T*>(slots[r]) + first;
        for (int64_t i = 0; i < count; ++i) acc[i] += static_cast<float>(sr[i]);
      }
      for (int64_t i = 0; i < count; ++i) out[first + i] = static_cast<T>(acc[i]);
    }
  });
}

constexpr int64_t kMaxRanks = 64;  // the slots' pointers live on the stack

class ShmAllReduce {
 public:
  // mapping: the whole shared mapping as uint8 (mapping_bytes(size, slot_bytes) long); its slot size
  // follows from its length.
  ShmAllReduce(torch::Tensor mapping, int64_t rank, int64_t size)
      : mapping_(std::move(mapping)), rank_(rank), size_(size) {
    TORCH_CHECK(mapping_.device().is_cpu() && mapping_.scalar_type() == torch::kUInt8 && mapping_.is_contiguous(),
                "the shared mapping must be a contiguous uint8 CPU tensor");
    TORCH_CHECK(size >= 1 && rank >= 0 && rank < size, "rank ", rank, " is not one of ", size, " ranks");
    TORCH_CHECK(size <= kMaxRanks, "shm all-reduce: at most ", kMaxRanks, " ranks");
    base_ = mapping_.data_ptr<uint8_t>();
    TORCH_CHECK(reinterpret_cast<uintptr_t>(base_) % kLine == 0, "the shared mapping must be cache-line aligned");
    slot_bytes_ = (mapping_.numel() - size * kLine) / (2 * size) / kLine * kLine;
    TORCH_CHECK(slot_bytes_ > 0, "a shared mapping of ", mapping_.numel(), " bytes is too small for ", size, " ranks");
  }

  static int64_t mapping_bytes(int64_t size, int64_t slot_bytes) {
    return size * kLine + 2 * size * round_up(slot_bytes, kLine);
  }

  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t seq() const { return static_cast<int64_t>(seq_); }

  // Starts the next call: x (contiguous, at most slot_bytes) into this rank's slot, then published.
  void publish(const torch::Tensor& x) {
    RECORD_FUNCTION("native::shm_all_reduce_publish", c10::ArrayRef<const c10::IValue>{});
    check(x);
    ++seq_;
    uint8_t* dst = slot(seq_, rank_);
    const auto* src = static_cast<const uint8_t*>(x.data_ptr());
    at::parallel_for(0, static_cast<int64_t>(x.nbytes()), kCopyGrain,
                     [&](int64_t begin, int64_t end) { std::memcpy(dst + begin, src + begin, end - begin); });
    __atomic_store_n(flag(rank_), seq_, __ATOMIC_RELEASE);
  }

  // Ends the published call: true once every rank has published it, x then holding the sum; false
  // if one has not within wait_seconds (call again).
  bool reduce(torch::Tensor x, double wait_seconds) {
    RECORD_FUNCTION("native::shm_all_reduce", c10::ArrayRef<const c10::IValue>{});
    check(x);
    TORCH_CHECK(seq_ > 0, "reduce() before publish()");
    if (!wait_all(std::chrono::duration<double>(wait_seconds))) return false;
    const uint8_t* slots[kMaxRanks];
    for (int64_t r = 0; r < size_; ++r) slots[r] = slot(seq_, r);
    switch (x.scalar_type()) {
      case torch::kFloat: sum_in_rank_order(x.data_ptr<float>(), slots, size_, x.numel()); break;
      case torch::kBFloat16: sum_in_rank_order(x.data_ptr<c10::BFloat16>(), slots, size_, x.numel()); break;
      default: sum_in_rank_order(x.data_ptr<c10::Half>(), slots, size_, x.numel());
    }
    return true;
  }

 private:
  void check(const torch::Tensor& x) const {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "shm all-reduce: x must be a contiguous CPU tensor");
    const auto t = x.scalar_type();
    TORCH_CHECK(t == torch::kFloat || t == torch::kBFloat16 || t == torch::kHalf,
                "shm all-reduce: float32, bfloat16 or float16 only, not ", t);
    TORCH_CHECK(static_cast<int64_t>(x.nbytes()) <= slot_bytes_, "shm all-reduce: ", x.nbytes(),
                " bytes do not fit a slot of ", slot_bytes_);
  }

  uint64_t* flag(int64_t rank) const { return reinterpret_cast<uint64_t*>(base_ + rank * kLine); }

  uint8_t* slot(uint64_t seq, int64_t rank) const {
    return base_ + size_ * kLine + (static_cast<int64_t>(seq & 1) * size_ + rank) * slot_bytes_;
  }

  bool wait_all(std::chrono::duration<double> wait) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    bool yield = false;
    int64_t next = 0;  // ranks below it have arrived (a flag, once >= seq_, stays so)
    for (int checks = 1;; ++checks) {
      while (next < size_ && __atomic_load_n(flag(next), __ATOMIC_ACQUIRE) >= seq_) ++next;
      if (next == size_) return true;
      if (checks % kChecksPerClockRead == 0) {
        const auto waited = clock::now() - start;
        if (waited >= wait) return false;
        yield = waited >= kSpinBeforeYield;
      }
      if (yield) {
        sched_yield();
      } else {
        cpu_relax();
      }
    }
  }

  torch::Tensor mapping_;  // keeps the mapping alive
  uint8_t* base_;
  int64_t rank_, size_, slot_bytes_;
  uint64_t seq_ = 0;
};

}  // namespace

void register_shm_allreduce(pybind11::module_& m) {
  pybind11::class_<ShmAllReduce>(m, "ShmAllReduce")
      .def(pybind11::init<torch::Tensor, int64_t, int64_t>(), pybind11::arg("mapping"), pybind11::arg("rank"),
           pybind11::arg("size"))
      .def_static("mapping_bytes", &ShmAllReduce::mapping_bytes, pybind11::arg("size"), pybind11::arg("slot_bytes"))
      .def_property_readonly("slot_bytes", &ShmAllReduce::slot_bytes)
      .def_property_readonly("seq", &ShmAllReduce::seq)
      .def("publish", &ShmAllReduce::publish, pybind11::arg("x"), ReleaseGil())
      .def("reduce", &ShmAllReduce::reduce, pybind11::arg("x"), pybind11::arg("wait_seconds"), ReleaseGil());
}
