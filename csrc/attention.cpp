// Softmax over the last dimension (vit_kernels::softmax), forward and backward, on the CPU: the
// attention probabilities of the extension's attention.
//
//   y = exp(x - max(x)) / sum(exp(x - max(x)))
//   backward: dx = y * (dy - sum(dy * y))

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>
#include <vector>

#include "checks.h"
#include "cpu_math.h"

namespace vit_kernels::cpu {
namespace {

constexpr const char* kForward = "vit_kernels::softmax";
constexpr const char* kBackward = "vit_kernels::softmax_backward";

template <typename acc_t>
VIT_KERNELS_CPU_CLONES void softmax_row(acc_t* __restrict y, const acc_t* __restrict x, int64_t n) {
  acc_t peak = -std::numeric_limits<acc_t>::infinity();
#pragma omp simd reduction(max : peak)
  for (int64_t i = 0; i < n; ++i) peak = x[i] > peak ? x[i] : peak;
  // A row of -inf has no maximum to subtract: it gives NaN, as torch.softmax does.
  acc_t total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) {
    y[i] = exp_of(x[i] - peak);
    total += y[i];
  }
  const acc_t inv = acc_t(1) / total;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= inv;
}

template <typename acc_t>
VIT_KERNELS_CPU_CLONES void softmax_grad_row(acc_t* __restrict dx, const acc_t* __restrict dy, const acc_t* __restrict y,
                                             int64_t n) {
  acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < n; ++i) dot += dy[i] * y[i];
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dx[i] = y[i] * (dy[i] - dot);
}

void check_rows(const char* op, const char* name, const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": ", name, " must have shape (..., C) with C > 0, got ", x.sizes());
  check_float_dtype(op, name, x, /*allow_double=*/true);
  check_contiguous(op, name, x);
  TORCH_CHECK(x.device().is_cpu(), op, ": expected CPU tensors here, got ", x.device());
}

}  // namespace

at::Tensor softmax_cpu(const at::Tensor& x) {
  check_rows(kForward, "x", x);
  at::Tensor y = at::empty_like(x);
  const int64_t cols = x.size(-1), rows = row_count(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "softmax_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    scalar_t* y_ptr = y.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> xs(cols), ys(cols);
      for (int64_t row = begin; row < end; ++row) {
        load_row(x_ptr + row * cols, xs.data(), cols);
        softmax_row(ys.data(), xs.data(), cols);
        store_row(ys.data(), y_ptr + row * cols, cols);
      }
    });
  });
  return y;
}

at::Tensor softmax_backward_cpu(const at::Tensor& grad_out, const at::Tensor& out) {
  check_rows(kBackward, "out", out);
  check_like(kBackward, "grad_out", grad_out, out);
  at::Tensor dx = at::empty_like(out);
  const int64_t cols = out.size(-1), rows = row_count(out);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "softmax_backward_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    const scalar_t* dy_ptr = grad_out.data_ptr<scalar_t>();
    const scalar_t* y_ptr = out.data_ptr<scalar_t>();
    scalar_t* dx_ptr = dx.data_ptr<scalar_t>();
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> dy(cols), ys(cols), result(cols);
      for (int64_t row = begin; row < end; ++row) {
        load_row(dy_ptr + row * cols, dy.data(), cols);
        load_row(y_ptr + row * cols, ys.data(), cols);
        softmax_grad_row(result.data(), dy.data(), ys.data(), cols);
        store_row(result.data(), dx_ptr + row * cols, cols);
      }
    });
  });
  return dx;
}

TORCH_LIBRARY_IMPL(vit_kernels, CPU, m) {
  m.impl("softmax", &softmax_cpu);
  m.impl("softmax_backward", &softmax_backward_cpu);
}

}  // namespace vit_kernels::cpu
