// LayerNorm with an optional fused residual add, forward and backward, on the CPU.
//
//   s = x + residual,  mean = sum(s) / C,  rstd = 1 / sqrt(sum((s - mean)^2) / C + eps)
//   xhat = (s - mean) * rstd,  y = xhat * weight + bias
// backward, with g = dy * weight:
//   ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) + d(s) from outside (the residual stream)
//   dweight = sum_rows(dy * xhat),  dbias = sum_rows(dy)
// Rows run in parallel (at::parallel_for); each row is converted once into an acc_t buffer and the
// loops over it vectorise. Weight/bias gradients are summed per chunk of rows, then over chunks.

#include <ATen/Parallel.h>
#include <algorithm>
#include <torch/library.h>

#include <vector>

#include "checks.h"
#include "cpu_math.h"

namespace vit_kernels {

// Checks shared with cuda/layer_norm.cu (declared in checks.h).
void check_layer_norm_args(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                           const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, bool cpu) {
  constexpr const char* op = "vit_kernels::fused_layer_norm";
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, op, ": x must have shape (..., C) with C > 0, got ", x.sizes());
  check_float_dtype(op, "x", x, cpu);
  check_contiguous(op, "x", x);
  if (residual.has_value()) check_like(op, "residual", *residual, x);
  if (weight.has_value()) check_vector(op, "weight", *weight, x, x.size(-1));
  if (bias.has_value()) check_vector(op, "bias", *bias, x, x.size(-1));
}

void check_layer_norm_backward_args(const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_summed,
                                    const at::Tensor& summed, const c10::optional<at::Tensor>& weight,
                                    const at::Tensor& mean, const at::Tensor& rstd, bool cpu) {
  constexpr const char* op = "vit_kernels::fused_layer_norm_backward";
  check_float_dtype(op, "summed", summed, cpu);
  check_contiguous(op, "summed", summed);
  TORCH_CHECK(summed.dim() >= 1 && summed.size(-1) > 0, op, ": summed must have shape (..., C), got ", summed.sizes());
  check_like(op, "grad_out", grad_out, summed);
  if (grad_summed.has_value()) check_like(op, "grad_summed", *grad_summed, summed);
  const int64_t cols = summed.size(-1), rows = row_count(summed);
  if (weight.has_value()) check_vector(op, "weight", *weight, summed, cols);
  const auto stat_dtype = summed.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  for (const auto& [name, stat] : {std::pair{"mean", &mean}, std::pair{"rstd", &rstd}}) {
    TORCH_CHECK(stat->dim() == 1 && stat->size(0) == rows && stat->scalar_type() == stat_dtype && stat->is_contiguous() &&
                    stat->device() == summed.device(),
                op, ": ", name, " must be a contiguous (", rows, ",) ", stat_dtype, " tensor on ", summed.device(),
                ", got ", stat->sizes(), " ", stat->scalar_type(), " on ", stat->device());
  }
}

namespace cpu {
namespace {

constexpr const char* kForward = "vit_kernels::fused_layer_norm";
constexpr const char* kBackward = "vit_kernels::fused_layer_norm_backward";

template <typename acc_t>
VIT_KERNELS_CPU_CLONES void add_rows(acc_t* __restrict s, const acc_t* __restrict r, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] += r[i];
}

// Two passes over the row in cache: the mean, then the centred sums (no cancellation). The
// corrected two-pass form: the centred values' own mean c removes the rounding of the first sum, so
// rows with a large mean and a small spread keep their digits; var = sum((s - m0)^2) / n - c^2.
template <typename acc_t>
VIT_KERNELS_CPU_CLONES void row_moments(const acc_t* __restrict s, int64_t n, acc_t eps, acc_t& mean, acc_t& rstd) {
  acc_t sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += s[i];
  const acc_t first = sum / acc_t(n);
  acc_t centred = 0, squares = 0;
#pragma omp simd reduction(+ : centred, squares)
  for (int64_t i = 0; i < n; ++i) {
    centred += s[i] - first;
    squares += (s[i] - first) * (s[i] - first);
  }
  const acc_t correction = centred / acc_t(n);
  mean = first + correction;
  // A variance past the float range has no finite reciprocal: NaN, as PyTorch gives, not a silent 0.
  const acc_t variance = std::max(squares / acc_t(n) - correction * correction, acc_t(0));
  rstd = std::isinf(variance) ? std::numeric_limits<acc_t>::quiet_NaN() : acc_t(1) / std::sqrt(variance + eps);
}

template <typename acc_t>
VIT_KERNELS_CPU_CLONES void normalize_row(acc_t* __restrict y, const acc_t* __restrict s, const acc_t* __restrict w,
                                          const acc_t* __restrict b, acc_t mean, acc_t rstd, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] = (s[i] - mean) * rstd * w[i] + b[i];
}

// ds for one row (see the formula above); accumulates dy * xhat and dy into dw, db.
template <typename acc_t>
VIT_KERNELS_CPU_CLONES void backward_row(acc_t* __restrict ds, const acc_t* __restrict s, const acc_t* __restrict dy,
                                         const acc_t* __restrict w, acc_t mean, acc_t rstd, int64_t n,
                                         acc_t* __restrict dw, acc_t* __restrict db, bool accumulate) {
  acc_t sum_g = 0, sum_gx = 0;
#pragma omp simd reduction(+ : sum_g, sum_gx)
  for (int64_t i = 0; i < n; ++i) {
    const acc_t xhat = (s[i] - mean) * rstd;
    const acc_t g = dy[i] * w[i];
    sum_g += g;
    sum_gx += g * xhat;
  }
  const acc_t c1 = sum_g / acc_t(n), c2 = sum_gx / acc_t(n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const acc_t xhat = (s[i] - mean) * rstd;
    ds[i] = rstd * (dy[i] * w[i] - c1 - xhat * c2);
  }
  if (accumulate) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      dw[i] += dy[i] * (s[i] - mean) * rstd;
      db[i] += dy[i];
    }
  }
}

// weight/bias as acc_t vectors, ones/zeros when absent, so the row loops have no branches.
template <typename scalar_t, typename acc_t>
std::vector<acc_t> vector_or(const c10::optional<at::Tensor>& t, int64_t n, acc_t fill) {
  std::vector<acc_t> out(n, fill);
  if (t.has_value()) load_row(t->data_ptr<scalar_t>(), out.data(), n);
  return out;
}

// Rows per task: enough work per task to amortise the scheduling (about 16K elements).
int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_layer_norm_cpu(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, double eps) {
  check_layer_norm_args(x, residual, weight, bias, /*cpu=*/true);
  TORCH_CHECK(x.device().is_cpu(), kForward, ": expected CPU tensors here, got ", x.device());
  const int64_t cols = x.size(-1), rows = row_count(x);
  const auto stat_dtype = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor y = at::empty_like(x);
  at::Tensor summed = residual.has_value() ? at::empty_like(x) : at::empty({0}, x.options());
  at::Tensor mean = at::empty({rows}, x.options().dtype(stat_dtype));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(stat_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "fused_layer_norm_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    const auto w = vector_or<scalar_t, acc_t>(weight, cols, acc_t(1));
    const auto b = vector_or<scalar_t, acc_t>(bias, cols, acc_t(0));
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    const scalar_t* r_ptr = residual.has_value() ? residual->data_ptr<scalar_t>() : nullptr;
    scalar_t* y_ptr = y.data_ptr<scalar_t>();
    scalar_t* s_ptr = residual.has_value() ? summed.data_ptr<scalar_t>() : nullptr;
    acc_t* mean_ptr = mean.data_ptr<acc_t>();
    acc_t* rstd_ptr = rstd.data_ptr<acc_t>();
    at::parallel_for(0, rows, grain_rows(cols), [&](int64_t begin, int64_t end) {
      std::vector<acc_t> s(cols), r(cols), out(cols);
      for (int64_t row = begin; row < end; ++row) {
        const int64_t offset = row * cols;
        load_row(x_ptr + offset, s.data(), cols);
        if (r_ptr != nullptr) {
          load_row(r_ptr + offset, r.data(), cols);
          add_rows(s.data(), r.data(), cols);
          store_row(s.data(), s_ptr + offset, cols);
          // Normalise s as stored (rounded to scalar_t), the same s the backward reads.
          if constexpr (!std::is_same_v<scalar_t, acc_t>) load_row(s_ptr + offset, s.data(), cols);
        }
        acc_t mu, inv;
        row_moments(s.data(), cols, static_cast<acc_t>(eps), mu, inv);
        mean_ptr[row] = mu;
        rstd_ptr[row] = inv;
        normalize_row(out.data(), s.data(), w.data(), b.data(), mu, inv, cols);
        store_row(out.data(), y_ptr + offset, cols);
      }
    });
  });
  return {y, summed, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_layer_norm_backward_cpu(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_summed, const at::Tensor& summed,
    const c10::optional<at::Tensor>& weight, const at::Tensor& mean, const at::Tensor& rstd, bool weight_bias_grad) {
  check_layer_norm_backward_args(grad_out, grad_summed, summed, weight, mean, rstd, /*cpu=*/true);
  TORCH_CHECK(summed.device().is_cpu(), kBackward, ": expected CPU tensors here, got ", summed.device());
  const int64_t cols = summed.size(-1), rows = row_count(summed);
  const auto stat_dtype = summed.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor ds = at::empty_like(summed);
  const int64_t chunks = weight_bias_grad ? std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows)) : 1;
  at::Tensor partial_w = at::zeros({chunks, weight_bias_grad ? cols : 0}, summed.options().dtype(stat_dtype));
  at::Tensor partial_b = at::zeros_like(partial_w);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, summed.scalar_type(), "fused_layer_norm_backward_cpu", [&] {
    using acc_t = acc_type<scalar_t>;
    const auto w = vector_or<scalar_t, acc_t>(weight, cols, acc_t(1));
    const scalar_t* s_ptr = summed.data_ptr<scalar_t>();
    const scalar_t* dy_ptr = grad_out.data_ptr<scalar_t>();
    const scalar_t* dsum_ptr = grad_summed.has_value() ? grad_summed->data_ptr<scalar_t>() : nullptr;
    scalar_t* ds_ptr = ds.data_ptr<scalar_t>();
    const acc_t* mean_ptr = mean.data_ptr<acc_t>();
    const acc_t* rstd_ptr = rstd.data_ptr<acc_t>();
    const int64_t rows_per_chunk = (rows + chunks - 1) / chunks;
    // One task per chunk of rows, so each task owns one row of the partial weight/bias sums.
    at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
      std::vector<acc_t> s(cols), dy(cols), out(cols), extra(cols), dw(cols), db(cols);
      for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk) {
        std::fill(dw.begin(), dw.end(), acc_t(0));
        std::fill(db.begin(), db.end(), acc_t(0));
        const int64_t end = std::min(rows, (chunk + 1) * rows_per_chunk);
        for (int64_t row = chunk * rows_per_chunk; row < end; ++row) {
          const int64_t offset = row * cols;
          load_row(s_ptr + offset, s.data(), cols);
          load_row(dy_ptr + offset, dy.data(), cols);
          backward_row(out.data(), s.data(), dy.data(), w.data(), mean_ptr[row], rstd_ptr[row], cols, dw.data(),
                       db.data(), weight_bias_grad);
          if (dsum_ptr != nullptr) {
            load_row(dsum_ptr + offset, extra.data(), cols);
            add_rows(out.data(), extra.data(), cols);
          }
          store_row(out.data(), ds_ptr + offset, cols);
        }
        if (weight_bias_grad) {
          std::copy(dw.begin(), dw.end(), partial_w.data_ptr<acc_t>() + chunk * cols);
          std::copy(db.begin(), db.end(), partial_b.data_ptr<acc_t>() + chunk * cols);
        }
      }
    });
  });
  return {ds, partial_w.sum(0), partial_b.sum(0)};
}

TORCH_LIBRARY_IMPL(vit_kernels, CPU, m) {
  m.impl("fused_layer_norm", &fused_layer_norm_cpu);
  m.impl("fused_layer_norm_backward", &fused_layer_norm_backward_cpu);
}

}  // namespace cpu
}  // namespace vit_kernels
