/* kvactor::q8_0_linear: `q8_0_gemv` (q8_0_gemv.c, linked as its built library) as a torch
 * operator, so a compiled graph or an eager step calls the product through the dispatcher
 * with no Python between the op and the kernel. It computes what the Python path of
 * `kernels.q8_0.Q8_0Packed.linear` does, in the same order: the rows in fp32, the product
 * over the packed tiles, the padding rows dropped, the bias added in fp32, the result in the
 * rows' dtype. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <optional>

extern "C" int q8_0_gemv(const float* x, int64_t B, int64_t H, const int8_t* pq, const void* ps,
                         int nsub, int half, const float* pm, int64_t V, float* out, int threads);

static void check_packed(const at::Tensor& t, at::ScalarType dtype, const char* what) {
  TORCH_CHECK_VALUE(t.scalar_type() == dtype && t.is_contiguous() && t.device().is_cpu(),
                    "q8_0_linear: ", what, " must be a contiguous CPU tensor of ", dtype);
}

static at::Tensor q8_0_linear(const at::Tensor& rows, const at::Tensor& q,
                              const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                              const std::optional<at::Tensor>& bias, int64_t out_features,
                              int64_t subblocks) {
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.device().is_cpu(),
                    "q8_0_linear: rows must be a 2-D CPU tensor");
  check_packed(q, at::kChar, "q");
  // fp16 scales: one a block and no minimums (the kernel's `half`)
  const bool half = scales.scalar_type() == at::kHalf && subblocks == 1 && !mins;
  check_packed(scales, half ? at::kHalf : at::kFloat, "scales");
  if (mins) check_packed(*mins, at::kFloat, "mins");
  const at::Tensor x = rows.to(at::kFloat).contiguous();
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK_VALUE(q.dim() == 2 && h == q.size(1) && h % 32 == 0, "q8_0_linear: rows of ", h,
                    " features for blocks of [", q.size(0), ", ", q.size(-1), "]");
  const int64_t padded = q.size(0);
  TORCH_CHECK_VALUE(out_features > 0 && out_features <= padded && padded % 16 == 0,
                    "q8_0_linear: ", out_features, " outputs from ", padded, " packed rows");
  TORCH_CHECK_VALUE(scales.numel() == padded * (h / 32) * subblocks,
                    "q8_0_linear: ", scales.numel(), " scales for ", subblocks, " a block");
  TORCH_CHECK_VALUE(!mins || mins->numel() == padded * (h / 32), "q8_0_linear: ",
                    mins ? mins->numel() : 0, " minimums for ", padded * (h / 32), " blocks");
  TORCH_CHECK_VALUE(!bias || (bias->dim() == 1 && bias->size(0) == out_features &&
                              bias->device().is_cpu()),
                    "q8_0_linear: the bias must be a CPU vector of ", out_features);
  at::Tensor out = at::empty({n, padded}, x.options());
  const int failed = q8_0_gemv(x.data_ptr<float>(), n, h, q.data_ptr<int8_t>(),
                               scales.data_ptr(), static_cast<int>(subblocks), half ? 1 : 0,
                               mins ? mins->data_ptr<float>() : nullptr, padded,
                               out.data_ptr<float>(), at::get_num_threads());
  TORCH_CHECK(failed != -1, "the Q8_0 kernel's scratch memory could not be allocated");
  TORCH_CHECK_VALUE(failed == 0, "the Q8_0 kernel refused ", subblocks, " scales a block");
  if (padded != out_features) out = out.narrow(1, 0, out_features).contiguous();
  if (bias) out.add_(*bias);
  return out.to(rows.scalar_type());
}

TORCH_LIBRARY_FRAGMENT(kvactor, m) {
  m.def(
      "q8_0_linear(Tensor rows, Tensor q, Tensor scales, Tensor? mins, Tensor? bias, "
      "int out_features, int subblocks) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvactor, CPU, m) { m.impl("q8_0_linear", &q8_0_linear); }
