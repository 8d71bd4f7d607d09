// Bias + GELU (vit_kernels::bias_gelu), the epilogue of linear_gelu (and of mlp's fc1) after a GEMM,
// forward and backward, on the CPU.
//
//   z = x + bias (per column),  y = gelu(z)           (erf, tanh or quick form, see cpu_math.h)
//   backward: dz = dy * gelu'(z),  d bias = sum_rows(dz) (float32; float64 for float64 inputs)
// z is recomputed in backward from x and bias rather than saved.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "cpu_math.h"

namespace vit_kernels::cpu {
namespace {

constexpr const char* kForward = "vit_kernels::bias_gelu";
constexpr const char* kBackward = "vit_kernels::bias_gelu_backward";

template <int kForm, typename acc_t>
VIT_KERNELS_CPU_CLONES void gelu_row(acc_t* __restrict y, const acc_t* __restrict x, const acc_t* __restrict b,
                                     int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = gelu<kForm>(x[i] + b[i]);
}

template <int kForm, typename acc_t>
VIT_KERNELS_CPU_CLONES void gelu_grad_row(acc_t* __restrict dz, const acc_t* __restrict dy, const acc_t* __restrict x,
                                          const acc_t* __restrict b, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dz[i] = dy[i] * gelu_grad<kForm>(x[i] + b[i]);
}

void check_input(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must have shape (..., C), got a 0-dim tensor");
  check_float_dtype(op, "x", x, /*allow_double=*/true);
  check_contiguous(op, "x", x);
  TORCH_CHECK(x.device().is_cpu(), op, ": expected CPU tensors here, got ", x.device());
  if (bias.has_value()) check_vector(op, "bias", *bias, x, x.size(-1));
}

// Runs `row_fn(acc_t* out, const acc_t* x, const acc_t* bias, row)` over every row in parallel.
template <typename scalar_t, typename RowFn>
void for_each_row(const at::Tensor& x, const c10::optional<at::Tensor>& bias, at::Tensor& out, RowFn row_fn) {
  using acc_t = acc_type<scalar_t>;
  const int64_t cols = x.size(-1), rows = row_count(x);
  if (x.numel() == 0) return;  // no rows, or rows of width 0 (as F.gelu, an empty result)
  std::vector<acc_t> b(cols, acc_t(0));
  if (bias.has_value()) load_row(bias->data_ptr<scalar_t>(), b.data(), cols);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> xs(cols), ys(cols), extra(cols);
    for (int64_t row = begin; row < end; ++row) {
      load_row(x_ptr + row * cols, xs.data(), cols);
      row_fn(ys.data(), xs.data(), b.data(), extra.data(), row);
      store_row(ys.data(), out_ptr + row * cols, cols);
    }
  });
}

}  // namespace

at::Tensor bias_gelu_cpu(const at::Tensor& x, const c10::optional<at::Tensor>& bias, c10::string_view approximate) {
  check_input(kForward, x, bias);
  const GeluForm form = gelu_form(kForward, std::string(approximate));
  at::Tensor y = at::empty_like(x);
  const int64_t cols = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    for_each_row<scalar_t>(x, bias, y, [&](acc_t* out, const acc_t* xs, const acc_t* b, acc_t*, int64_t) {
      with_gelu_form(form, [&](auto form_tag) { gelu_row<decltype(form_tag)::value>(out, xs, b, cols); });
    });
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                          const c10::optional<at::Tensor>& bias,
                                                          c10::string_view approximate, bool bias_grad) {
  check_input(kBackward, x, bias);
  check_like(kBackward, "grad_out", grad_out, x);
  const GeluForm form = gelu_form(kBackward, std::string(approximate));
  at::Tensor dz = at::empty_like(x);
  const int64_t cols = x.size(-1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "bias_gelu_backward_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* dy_ptr = grad_out.data_ptr<scalar_t>();
    for_each_row<scalar_t>(x, bias, dz, [&](acc_t* out, const acc_t* xs, const acc_t* b, acc_t* dy, int64_t row) {
      load_row(dy_ptr + row * cols, dy, cols);
      with_gelu_form(form, [&](auto form_tag) { gelu_grad_row<decltype(form_tag)::value>(out, dy, xs, b, cols); });
    });
  });
  const auto reduced = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  if (!bias_grad) return {dz, at::empty({0}, x.options().dtype(reduced))};
  return {dz, dz.reshape({-1, cols}).sum(0, /*keepdim=*/false, reduced)};
}

TORCH_LIBRARY_IMPL(vit_kernels, CPU, m) {
  m.impl("bias_gelu", &bias_gelu_cpu);
  m.impl("bias_gelu_backward", &bias_gelu_backward_cpu);
}

}  // namespace vit_kernels::cpu
