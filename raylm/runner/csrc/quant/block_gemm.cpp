// Matmuls on weights kept in block formats (block_formats.h: ggml's, as a GGUF file stores them, and raylm's FP8
// one): y = x W^T with x float32 [M, K] and W [N, K] quantized along K in blocks of 32 weights, one row of blocks per
// output feature.
// Few rows (decode): every block is decoded in registers once and used by all rows of x; more rows (prefill): panels
// of W decoded to float32 in L1 against x packed in columns (float_panels.h).
// Plain C++ for the compiler to vectorize (-O3 -march=native), with AVX2 intrinsics for the decode where present.
// For bfloat16 activations, GEMM plan candidates beside it: block_gemm_int8, the few-row kernel on int8 x
// (int8_dot.h), and block_gemm_bf16 / block_gemm_amx, blocks decoded to bfloat16 for AVX512-BF16's dot products
// (bf16_gemm.h) or AMX's tiles (amx_gemm.h).
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "activation_quant.h"
#include "amx_gemm.h"
#include "block_formats.h"
#include "float_panels.h"
#include "int8_dot.h"
#include "bf16_gemm.h"

namespace raylm {
namespace {

using quant::decode_floats;
using quant::F8_E4M3;
using quant::gemm_rows;
using quant::kBlock;
using quant::kF8E4M3;
using quant::Q4_0;
using quant::Q4_1;
using quant::Q8_0;

// Rows [n0, n1) of W as float32, row after row into `out` (K floats each).
template <class B>
void dequantize_rows(const uint8_t* w, int64_t nblocks, float* out, int64_t n0, int64_t n1) {
  const int64_t row_bytes = nblocks * B::kBytes, k = nblocks * kBlock;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      decode_floats<B>(w + n * row_bytes + blk * B::kBytes, out + (n - n0) * k + blk * kBlock);
    }
  }
}

// Weight rows per parallel chunk: ~64K weights, so that a small decode matmul stays on the calling thread.
inline int64_t grain_rows(int64_t k) { return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(k, 1)); }

template <class B>
void gemm_direct(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t n, float* y) {
  const int64_t nblocks = k / kBlock;
  std::vector<float> xsum(m * nblocks);
  for (int64_t i = 0; i < m * nblocks; ++i) {
    float total = 0.0f;
    for (int64_t j = 0; j < kBlock; ++j) total += x[i * kBlock + j];
    xsum[i] = total;
  }
  at::parallel_for(0, n, grain_rows(k), [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4)
      gemm_rows<B, 4>(x + r * k, k, xsum.data() + r * nblocks, w, nblocks, y + r * n, n, n0, n1);
    for (; r + 2 <= m; r += 2)
      gemm_rows<B, 2>(x + r * k, k, xsum.data() + r * nblocks, w, nblocks, y + r * n, n, n0, n1);
    for (; r < m; ++r) gemm_rows<B, 1>(x + r * k, k, xsum.data() + r * nblocks, w, nblocks, y + r * n, n, n0, n1);
  });
}

template <class B>
torch::Tensor gemm_int8(const torch::Tensor& x, const torch::Tensor& w, int64_t n) {
  const int64_t m = x.size(0), k = x.size(1), nblocks = k / kBlock;
  TORCH_CHECK(k % kBlock == 0, "in_features ", k, " is not a multiple of the ", kBlock, "-weight block");
  TORCH_CHECK(w.size(0) == n && w.size(1) == nblocks * B::kBytes, "weight of shape ", w.sizes(), " does not hold ", n,
              " rows of ", k, " quantized weights");
  torch::Tensor y = torch::empty({m, n}, x.options());
  const quant::Int8Rows xq = quant::quantize_rows(x.data_ptr<float>(), m, k);
  const uint8_t* ws = w.data_ptr<uint8_t>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, n, grain_rows(k), [&](int64_t n0, int64_t n1) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) quant::gemm_rows_int8<B, 4>(xq, r, ws, nblocks, ys + r * n, n, n0, n1);
    for (; r + 2 <= m; r += 2) quant::gemm_rows_int8<B, 2>(xq, r, ws, nblocks, ys + r * n, n, n0, n1);
    for (; r < m; ++r) quant::gemm_rows_int8<B, 1>(xq, r, ws, nblocks, ys + r * n, n, n0, n1);
  });
  return y;
}

template <class B>
torch::Tensor block_gemm_impl(const torch::Tensor& x, const torch::Tensor& w, int64_t n, int64_t max_direct_rows) {
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "in_features ", k, " is not a multiple of the ", kBlock, "-weight block");
  TORCH_CHECK(w.size(0) == n && w.size(1) == k / kBlock * B::kBytes, "weight of shape ", w.sizes(),
              " does not hold ", n, " rows of ", k, " quantized weights");
  torch::Tensor y = torch::empty({m, n}, x.options());
  if (m <= max_direct_rows) {
    gemm_direct<B>(x.data_ptr<float>(), m, k, w.data_ptr<uint8_t>(), n, y.data_ptr<float>());
  } else {
    quant::float_panels<B>(x.data_ptr<float>(), m, k, w.data_ptr<uint8_t>(), n, y.data_ptr<float>());
  }
  return y;
}

template <class B>
torch::Tensor dequantize_impl(const torch::Tensor& w, const torch::Tensor& rows, int64_t k) {
  const int64_t count = rows.size(0), nblocks = k / kBlock;
  torch::Tensor out = torch::empty({count, k}, torch::kFloat32);
  const int64_t* ids = rows.data_ptr<int64_t>();
  const uint8_t* base = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, count, std::max<int64_t>(1, grain_rows(k) / 4), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < w.size(0), "row ", ids[i], " out of range");
      dequantize_rows<B>(base + ids[i] * nblocks * B::kBytes, nblocks, dst + i * k, 0, 1);
    }
  });
  return out;
}

void check(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D float32 CPU tensor");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "the weight must be a contiguous 2-D uint8 CPU tensor of blocks");
}

}  // namespace

// qtype: ggml's type number (2 = Q4_0, 3 = Q4_1, 8 = Q8_0) or raylm's (kF8E4M3 = 1024 for F8_E4M3). Batches of up
// to max_direct_rows rows decode each block in registers for all rows; larger ones decode panels of W to float32.
torch::Tensor block_gemm(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t n,
                         int64_t max_direct_rows) {
  check(x, w);
  switch (qtype) {
    case 2: return block_gemm_impl<Q4_0>(x, w, n, max_direct_rows);
    case 3: return block_gemm_impl<Q4_1>(x, w, n, max_direct_rows);
    case 8: return block_gemm_impl<Q8_0>(x, w, n, max_direct_rows);
    case kF8E4M3: return block_gemm_impl<F8_E4M3>(x, w, n, max_direct_rows);
  }
  TORCH_CHECK(false, "ggml type ", qtype, " has no kernel");
}

// y = x W^T (+ bias) for x [m, k] (float32 or bfloat16) quantized to int8 per block of 32 (a scale each, as ggml's
// Q8_0), by integer dot products with W's blocks (int8_dot.h): summed in float32, the bias added there, y rounded to
// x's dtype once. The casts run here, not as torch ops from Python: at a decode step's few rows they cost more than
// the product of a small weight.
torch::Tensor block_gemm_int8(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t n,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) &&
                  x.dim() == 2,
              "x must be a 2-D float32 or bfloat16 CPU tensor");
  const torch::Tensor x32 = x.to(torch::kFloat32).contiguous();
  check(x32, w);
  torch::Tensor y;
  switch (qtype) {
    case 2: y = gemm_int8<Q4_0>(x32, w, n); break;
    case 3: y = gemm_int8<Q4_1>(x32, w, n); break;
    case 8: y = gemm_int8<Q8_0>(x32, w, n); break;
    // Integer dot products need integer weights; the GEMM plan never offers this kernel for F8_E4M3.
    case kF8E4M3: TORCH_CHECK(false, "F8_E4M3 blocks have no int8-dot kernel: E4M3 values are not integers");
    default: TORCH_CHECK(false, "ggml type ", qtype, " has no kernel");
  }
  if (bias) y.add_(*bias);
  return y.to(x.scalar_type());
}

// The bytes of one block of ggml type `qtype` (raylm's for F8_E4M3).
int64_t block_bytes(int64_t qtype) {
  switch (qtype) {
    case 2: return Q4_0::kBytes;
    case 3: return Q4_1::kBytes;
    case 8: return Q8_0::kBytes;
    case kF8E4M3: return F8_E4M3::kBytes;
  }
  TORCH_CHECK(false, "ggml type ", qtype, " has no kernel");
}

// What the bfloat16 kernels take: x bfloat16 [m, k] of whole blocks, w n rows of qtype's blocks over k, bias float32
// [n] or None. Returns the bias's data (nullptr for None).
const float* check_bf16_call(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t n,
                             const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous 2-D bfloat16 CPU tensor");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() &&
                  w.size(0) == n,
              "the weight must be a contiguous 2-D uint8 CPU tensor of ", n, " rows of blocks");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % kBlock == 0, "in_features ", k, " is not a multiple of the ", kBlock, "-weight block");
  TORCH_CHECK(w.size(1) == k / kBlock * block_bytes(qtype), "weight rows do not hold ", k, " weights of ggml type ",
              qtype);
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n),
              "bias must be a contiguous float32 tensor of ", n, " values");
  return bias ? bias->data_ptr<float>() : nullptr;
}

// y = x W^T (+ bias) on AMX tiles (amx_gemm.h): x bfloat16 [m, k], bias float32 [n] or None, y bfloat16 [m, n].
torch::Tensor block_gemm_amx(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t n,
                             const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(quant::amx_available(), "this build or CPU has no AMX-BF16 tiles (check amx_available() first)");
  const float* b = check_bf16_call(x, w, qtype, n, bias);
  torch::Tensor y = torch::empty({x.size(0), n}, x.options());
#ifdef RAYLM_AMX
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const uint8_t* ws = w.data_ptr<uint8_t>();
  const int64_t m = x.size(0), k = x.size(1);
  switch (qtype) {
    case 2: quant::amx_gemm<Q4_0>(xs, m, k, ws, n, b, ys); return y;
    case 3: quant::amx_gemm<Q4_1>(xs, m, k, ws, n, b, ys); return y;
    case 8: quant::amx_gemm<Q8_0>(xs, m, k, ws, n, b, ys); return y;
    case kF8E4M3: quant::amx_gemm<F8_E4M3>(xs, m, k, ws, n, b, ys); return y;
  }
#endif
  TORCH_CHECK(false, "ggml type ", qtype, " has no AMX kernel");
}

// y = x W^T (+ bias) by AVX512-BF16's dot products on blocks decoded to bfloat16 (bf16_gemm.h): x bfloat16 [m, k],
// bias float32 [n] or None, y bfloat16 [m, n]; batches of up to max_direct_rows rows (kMaxDirectRowsBf16 unless a
// test asks otherwise) decode blocks in registers.
torch::Tensor block_gemm_bf16(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype, int64_t n,
                              const c10::optional<torch::Tensor>& bias, int64_t max_direct_rows) {
  TORCH_CHECK(quant::bf16_dot_available(), "this build has no AVX512-BF16 dot products (check bf16_dot_available())");
  const float* b = check_bf16_call(x, w, qtype, n, bias);
  torch::Tensor y = torch::empty({x.size(0), n}, x.options());
#ifdef RAYLM_BF16_BLOCKS
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* ys = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const uint8_t* ws = w.data_ptr<uint8_t>();
  const int64_t m = x.size(0), k = x.size(1), most = max_direct_rows;
  switch (qtype) {
    case 2: quant::bf16_gemm<Q4_0>(xs, m, k, ws, n, b, ys, most); return y;
    case 3: quant::bf16_gemm<Q4_1>(xs, m, k, ws, n, b, ys, most); return y;
    case 8: quant::bf16_gemm<Q8_0>(xs, m, k, ws, n, b, ys, most); return y;
    case kF8E4M3: quant::bf16_gemm<F8_E4M3>(xs, m, k, ws, n, b, ys, most); return y;
  }
#endif
  TORCH_CHECK(false, "ggml type ", qtype, " has no kernel");
}

// Rows `rows` of W as float32 [len(rows), k]: the embedding lookup of a quantized table.
torch::Tensor block_dequantize(const torch::Tensor& w, const torch::Tensor& rows, int64_t qtype, int64_t k) {
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && rows.scalar_type() == torch::kInt64 &&
                  rows.dim() == 1 && rows.is_contiguous(),
              "block_dequantize takes contiguous uint8 blocks and int64 row ids");
  switch (qtype) {
    case 2: return dequantize_impl<Q4_0>(w, rows, k);
    case 3: return dequantize_impl<Q4_1>(w, rows, k);
    case 8: return dequantize_impl<Q8_0>(w, rows, k);
    case kF8E4M3: return dequantize_impl<F8_E4M3>(w, rows, k);
  }
  TORCH_CHECK(false, "ggml type ", qtype, " has no kernel");
}

// The CPU layer stack's call into these kernels (cpu_kernels' decoder_layers.h, a separate library, holds its
// address; the two are built from the same torch headers): y = x W^T (+ bias) in x's dtype, by `kernel` 1 `packed`,
// 2 `packed_int8`, 3 `amx` or 4 `packed_bf16` (decoder_layers.h's LinearKernel), with the casts and bias add the
// layer's path makes around the same kernel (quantization/kernels.py), so the stacked layers equal it bit for bit.
torch::Tensor stack_linear(const torch::Tensor& x, const torch::Tensor& w, int64_t kernel, int64_t qtype, int64_t n,
                           const c10::optional<torch::Tensor>& bias, int64_t max_direct_rows) {
  if (kernel == 3) {
    return block_gemm_amx(x, w, qtype, n,
                          bias ? c10::optional<torch::Tensor>(bias->to(torch::kFloat)) : c10::nullopt);
  }
  if (kernel == 4) {
    return block_gemm_bf16(x, w, qtype, n, bias ? c10::optional<torch::Tensor>(bias->to(torch::kFloat)) : c10::nullopt,
                           quant::kMaxDirectRowsBf16);
  }
  TORCH_CHECK(kernel == 1 || kernel == 2, "stack_linear: kernel ", kernel,
              " is not packed (1), packed_int8 (2), amx (3) or packed_bf16 (4)");
  if (kernel == 2) return block_gemm_int8(x, w, qtype, n, bias);
  torch::Tensor y = block_gemm(x.to(torch::kFloat).contiguous(), w, qtype, n, max_direct_rows);
  if (bias) y.add_(*bias);
  return y.to(x.scalar_type());
}

}  // namespace raylm

// Every kernel runs without the GIL (after its arguments are read): the engine's other Python threads (a server's
// event loop, async scheduling) run meanwhile, as they do during torch's own ops.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto kNoGil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("block_gemm", &raylm::block_gemm, kNoGil);
  m.def("block_gemm_int8", &raylm::block_gemm_int8, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("qtype"),
        pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(), kNoGil);
  // The instruction set the integer kernel was built for: avx512_vnni, avx_vnni, avx2 or portable.
  m.def("int8_path", [] { return std::string(raylm::quant::kInt8Path); });
  m.def("block_dequantize", &raylm::block_dequantize, kNoGil);
  m.def("block_gemm_amx", &raylm::block_gemm_amx, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("qtype"),
        pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(), kNoGil);
  m.def("amx_available", &raylm::quant::amx_available);
  m.def("block_gemm_bf16", &raylm::block_gemm_bf16, pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("qtype"),
        pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("max_direct_rows") = raylm::quant::kMaxDirectRowsBf16, kNoGil);
  m.def("bf16_dot_available", &raylm::quant::bf16_dot_available);
  m.def("quantize_activations", &raylm::quant::quantize_activations, kNoGil);
  m.def("stack_linear_address", [] { return reinterpret_cast<int64_t>(&raylm::stack_linear); });
}
