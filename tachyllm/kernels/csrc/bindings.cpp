// Python bindings of the kernels (loaded by tachyllm/kernels/native.py).
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "tachyllm C++ CPU kernels";
  m.def("rms_norm", &rms_norm, "out <- RMSNorm(x) * weight", ReleaseGil());
  m.def("add_rms_norm", &add_rms_norm, "residual <- x + residual; x <- RMSNorm(residual) * weight", ReleaseGil());
  m.def("rotary_inplace", &rotary_inplace, "rotate q and k in place (half-split layout)", ReleaseGil());
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of a fused [tokens, 2 * inter] projection", ReleaseGil());
  m.def("write_kv", &write_kv,
        "write K/V rows into the paged cache at the given flat slots (int8 / fp8 caches: value / scale, rounded, "
        "saturated)",
        pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("slots"), pybind11::arg("k_scale") = pybind11::none(),
        pybind11::arg("v_scale") = pybind11::none(), ReleaseGil());
  m.def("paged_attention", &paged_attention,
        "attention of each sequence's queries over its paged context (int8 / fp8 caches with per-KV-head scales;"
        " window > 0: sliding-window attention)",
        pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_info"), pybind11::arg("scale"),
        pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none(),
        pybind11::arg("window") = 0, ReleaseGil());
  m.def("encoder_attention", &encoder_attention,
        "bidirectional attention of each packed input of an encoder step over itself (rows seq_starts[b] .. "
        "seq_starts[b + 1]), no KV cache",
        pybind11::arg("out"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("seq_starts"),
        pybind11::arg("scale"), ReleaseGil());
  m.def("bind_team_threads", &bind_team_threads,
        "pin thread t >= 1 of the caller's OpenMP team to cpus[t] (< 0: left); each thread's CPU, -1 where unset",
        pybind11::arg("cpus"), ReleaseGil());
  register_quant_gemv(m);
  register_bf16_gemv(m);
  register_decode_layer(m);
  register_lora(m);
  register_shm_allreduce(m);
  register_suffix_tree(m);
}
