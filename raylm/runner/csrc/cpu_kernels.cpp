// Fused CPU kernels for the decoder's memory-bound steps, on float32 or bfloat16 tensors (computing in float32):
// RMSNorm (with the residual add), SiLU-and-mul, neox rotary (layer_ops.h), the KV cache write (kv_cache_write.h) and
// paged attention (paged_attention.h), the few-row linear (skinny_gemm.h), and a decoder layer stack of them in one
// call (decoder_layers.h); the batched LoRA product (lora_ops.h), float32.
// Plain loops written for the compiler to vectorize (-O3 -march=native); threads come from ATen's
// pool, so torch.set_num_threads governs them as it does every other op.
#include "decoder_layers.h"
#include "layer_ops.h"
#include "lora_ops.h"
#include "paged_attention.h"
#include "skinny_gemm.h"

// Every kernel runs without the GIL (after its arguments are read): the engine's other Python threads (a server's
// event loop, async scheduling) run meanwhile, as they do during torch's own ops.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto kNoGil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("rms_norm", &raylm::rms_norm, kNoGil);
  m.def("fused_add_rms_norm", &raylm::fused_add_rms_norm, kNoGil);
  m.def("silu_and_mul", &raylm::silu_and_mul, kNoGil);
  m.def("rotary_embedding", &raylm::rotary_embedding, kNoGil);
  m.def("write_kv", &raylm::write_kv, kNoGil);
  namespace py = pybind11;
  m.def("paged_attention", &raylm::paged_attention, kNoGil, py::arg("out"), py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("block_table"), py::arg("seq_lens"), py::arg("query_start_loc"),
        py::arg("scale"), py::arg("sliding_window") = 0, py::arg("soft_cap") = 0.0,
        py::arg("sinks") = py::none());
  m.def("add_lora", &raylm::add_lora, kNoGil);
  m.def("pack_skinny", &raylm::pack_skinny, kNoGil);
  m.def("skinny_linear", &raylm::skinny_linear, kNoGil);
  m.def("decoder_layers", &raylm::decoder_layers, kNoGil);
  // Whether this build's bfloat16 linear multiplies pairs with vdpbf16ps (AVX512-BF16), or widens them first.
  m.attr("native_bf16") = raylm::kNativeBf16;
}
