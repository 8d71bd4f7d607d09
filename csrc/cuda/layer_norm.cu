// LayerNorm with an optional fused residual add, forward and backward, on CUDA.
//
//   s = x + residual,  mean = sum(s) / C,  rstd = 1 / sqrt(sum((s - mean)^2) / C + eps)
//   y = (s - mean) * rstd * weight + bias
// backward, with xhat = (s - mean) * rstd and g = dy * weight:
//   ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) + d(s) from outside
//   dweight = sum_rows(dy * xhat),  dbias = sum_rows(dy)
// Forward: one block per row; the row of s is kept in shared memory (fp32) between the passes, so
// x and residual are read once. Backward: each block walks a chunk of rows and keeps its columns'
// partial dweight / dbias in shared memory; the host sums the per-block partials.

#include <torch/library.h>

#include "common.cuh"

namespace vit_kernels::cuda {
namespace {

constexpr const char* kForward = "vit_kernels::fused_layer_norm";
constexpr const char* kBackward = "vit_kernels::fused_layer_norm_backward";
// Shared memory budget: the forward's fp32 row (24 KiB), the backward's two fp32 partial rows
// (48 KiB + scratch, past the default 48 KiB limit, so the backward opts in to more).
constexpr int64_t kMaxColumns = 6144;

template <typename scalar_t, int kVec>
__device__ __forceinline__ void load(const scalar_t* row, int64_t col, float (&out)[kVec]) {
  if constexpr (kVec == Pack<scalar_t>::kSize) {
    const Pack<scalar_t> pack = *reinterpret_cast<const Pack<scalar_t>*>(row + col);
#pragma unroll
    for (int k = 0; k < kVec; ++k) out[k] = static_cast<float>(pack.v[k]);
  } else {
    out[0] = static_cast<float>(row[col]);
  }
}

template <typename scalar_t, int kVec>
__device__ __forceinline__ void store(scalar_t* row, int64_t col, const float (&in)[kVec]) {
  if constexpr (kVec == Pack<scalar_t>::kSize) {
    Pack<scalar_t> pack;
#pragma unroll
    for (int k = 0; k < kVec; ++k) pack.v[k] = static_cast<scalar_t>(in[k]);
    *reinterpret_cast<Pack<scalar_t>*>(row + col) = pack;
  } else {
    row[col] = static_cast<scalar_t>(in[0]);
  }
}

// kVec: elements per load (a whole 16-byte pack when the row allows it, else 1).
template <typename scalar_t, int kVec>
__global__ void layer_norm_fwd_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ residual,
                                      const scalar_t* __restrict__ weight, const scalar_t* __restrict__ bias,
                                      scalar_t* __restrict__ y, scalar_t* __restrict__ summed, float* __restrict__ mean,
                                      float* __restrict__ rstd, int64_t cols, float eps) {
  extern __shared__ float shared[];
  float* scratch = shared;       // 32 floats for block reductions
  float* s_row = shared + 32;    // cols floats
  const int64_t row = blockIdx.x;
  const int64_t offset = row * cols;
  float sum = 0.0f;
  for (int64_t col = threadIdx.x * kVec; col < cols; col += blockDim.x * kVec) {
    float s[kVec];
    load<scalar_t, kVec>(x + offset, col, s);
    if (residual != nullptr) {
      float r[kVec];
      load<scalar_t, kVec>(residual + offset, col, r);
      // s is normalised as stored (rounded to scalar_t), the same s the backward reads.
#pragma unroll
      for (int k = 0; k < kVec; ++k) s[k] = static_cast<float>(static_cast<scalar_t>(s[k] + r[k]));
      store<scalar_t, kVec>(summed + offset, col, s);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      s_row[col + k] = s[k];
      sum += s[k];
    }
  }
  const float first = block_sum(sum, scratch) / static_cast<float>(cols);
  // Corrected two-pass moments: the centred values' own mean removes the rounding of the first sum.
  float centred = 0.0f, squares = 0.0f;
  for (int64_t col = threadIdx.x * kVec; col < cols; col += blockDim.x * kVec) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float d = s_row[col + k] - first;
      centred += d;
      squares += d * d;
    }
  }
  const float correction = block_sum(centred, scratch) / static_cast<float>(cols);
  const float mu = first + correction;
  const float variance = fmaxf(block_sum(squares, scratch) / static_cast<float>(cols) - correction * correction, 0.0f);
  // A variance past the float range has no finite reciprocal: NaN, as PyTorch gives, not a silent 0.
  const float inv = isinf(variance) ? __int_as_float(0x7fc00000) : rsqrtf(variance + eps);
  if (threadIdx.x == 0) {
    mean[row] = mu;
    rstd[row] = inv;
  }
  for (int64_t col = threadIdx.x * kVec; col < cols; col += blockDim.x * kVec) {
    float w[kVec], b[kVec], out[kVec];
    if (weight != nullptr) load<scalar_t, kVec>(weight, col, w);
    if (bias != nullptr) load<scalar_t, kVec>(bias, col, b);
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      out[k] = (s_row[col + k] - mu) * inv * (weight != nullptr ? w[k] : 1.0f) + (bias != nullptr ? b[k] : 0.0f);
    store<scalar_t, kVec>(y + offset, col, out);
  }
}

template <typename scalar_t, int kVec>
__global__ void layer_norm_bwd_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ grad_summed,
                                      const scalar_t* __restrict__ summed, const scalar_t* __restrict__ weight,
                                      const float* __restrict__ mean, const float* __restrict__ rstd,
                                      scalar_t* __restrict__ ds, float* __restrict__ partial_w,
                                      float* __restrict__ partial_b, int64_t rows, int64_t cols,
                                      int64_t rows_per_block, bool weight_bias_grad) {
  extern __shared__ float shared[];
  float* scratch = shared;
  float* dw = shared + 32;
  float* db = dw + cols;
  // Each thread owns the same columns in every row, so its dw/db entries need no synchronisation.
  for (int64_t col = threadIdx.x * kVec; col < cols; col += blockDim.x * kVec)
#pragma unroll
    for (int k = 0; k < kVec; ++k) dw[col + k] = db[col + k] = 0.0f;
  const int64_t first = blockIdx.x * rows_per_block;
  const int64_t last = min(rows, first + rows_per_block);
  for (int64_t row = first; row < last; ++row) {
    const int64_t offset = row * cols;
    const float mu = mean[row], inv = rstd[row];
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int64_t col = threadIdx.x * kVec; col < cols; col += blockDim.x * kVec) {
      float s[kVec], dy[kVec], w[kVec];
      load<scalar_t, kVec>(summed + offset, col, s);
      load<scalar_t, kVec>(grad_out + offset, col, dy);
      if (weight != nullptr) load<scalar_t, kVec>(weight, col, w);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float xhat = (s[k] - mu) * inv;
        const float g = dy[k] * (weight != nullptr ? w[k] : 1.0f);
        sum_g += g;
        sum_gx += g * xhat;
        if (weight_bias_grad) {
          dw[col + k] += dy[k] * xhat;
          db[col + k] += dy[k];
        }
      }
    }
    const float c1 = block_sum(sum_g, scratch) / static_cast<float>(cols);
    const float c2 = block_sum(sum_gx, scratch) / static_cast<float>(cols);
    // Second pass over the row: its loads hit the L1 / L2 cache.
    for (int64_t col = threadIdx.x * kVec; col < cols; col += blockDim.x * kVec) {
      float s[kVec], dy[kVec], w[kVec], extra[kVec], out[kVec];
      load<scalar_t, kVec>(summed + offset, col, s);
      load<scalar_t, kVec>(grad_out + offset, col, dy);
      if (weight != nullptr) load<scalar_t, kVec>(weight, col, w);
      if (grad_summed != nullptr) load<scalar_t, kVec>(grad_summed + offset, col, extra);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float xhat = (s[k] - mu) * inv;
        const float g = dy[k] * (weight != nullptr ? w[k] : 1.0f);
        out[k] = inv * (g - c1 - xhat * c2) + (grad_summed != nullptr ? extra[k] : 0.0f);
      }
      store<scalar_t, kVec>(ds + offset, col, out);
    }
  }
  if (weight_bias_grad) {
    for (int64_t col = threadIdx.x * kVec; col < cols; col += blockDim.x * kVec)
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        partial_w[blockIdx.x * cols + col + k] = dw[col + k];
        partial_b[blockIdx.x * cols + col + k] = db[col + k];
      }
  }
}

template <typename T>
const T* optional_ptr(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_layer_norm_cuda(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& weight,
    const c10::optional<at::Tensor>& bias, double eps) {
  check_cuda_input(kForward, "x", x);
  check_layer_norm_args(x, residual, weight, bias, /*cpu=*/false);
  TORCH_CHECK(x.size(-1) <= kMaxColumns, kForward, ": x must have shape (..., C) with C <= ", kMaxColumns,
              " on CUDA, got ", x.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = row_count(x);
  at::Tensor y = at::empty_like(x);
  at::Tensor summed = residual.has_value() ? at::empty_like(x) : at::empty({0}, x.options());
  at::Tensor mean = at::empty({rows}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, summed, mean, rstd};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const size_t shared_bytes = (32 + cols) * sizeof(float);
  VIT_KERNELS_DISPATCH_CUDA_FLOATS(x.scalar_type(), "fused_layer_norm_cuda", [&] {
    const scalar_t* r = optional_ptr<scalar_t>(residual);
    const scalar_t* w = optional_ptr<scalar_t>(weight);
    const scalar_t* b = optional_ptr<scalar_t>(bias);
    scalar_t* s = residual.has_value() ? summed.data_ptr<scalar_t>() : nullptr;
    constexpr int kPack = Pack<scalar_t>::kSize;
    if (packs_fit<scalar_t>(cols, {x.data_ptr(), r, w, b, y.data_ptr(), s})) {
      layer_norm_fwd_kernel<scalar_t, kPack><<<rows, threads_for(cols / kPack, 512), shared_bytes, stream>>>(
          x.data_ptr<scalar_t>(), r, w, b, y.data_ptr<scalar_t>(), s, mean.data_ptr<float>(), rstd.data_ptr<float>(),
          cols, static_cast<float>(eps));
    } else {
      layer_norm_fwd_kernel<scalar_t, 1><<<rows, threads_for(cols, 512), shared_bytes, stream>>>(
          x.data_ptr<scalar_t>(), r, w, b, y.data_ptr<scalar_t>(), s, mean.data_ptr<float>(), rstd.data_ptr<float>(),
          cols, static_cast<float>(eps));
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {y, summed, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_layer_norm_backward_cuda(
    const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_summed, const at::Tensor& summed,
    const c10::optional<at::Tensor>& weight, const at::Tensor& mean, const at::Tensor& rstd, bool weight_bias_grad) {
  check_cuda_input(kBackward, "summed", summed);
  check_layer_norm_backward_args(grad_out, grad_summed, summed, weight, mean, rstd, /*cpu=*/false);
  TORCH_CHECK(summed.size(-1) <= kMaxColumns, kBackward, ": summed must have shape (..., C) with C <= ", kMaxColumns,
              " on CUDA, got ", summed.sizes());
  const int64_t cols = summed.size(-1), rows = row_count(summed);
  const c10::cuda::CUDAGuard guard(summed.device());
  at::Tensor ds = at::empty_like(summed);
  // Enough blocks to fill the GPU a few times over; each owns a contiguous chunk of rows.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(rows, 4 * multiprocessor_count(summed.get_device())));
  const int64_t rows_per_block = (rows + blocks - 1) / blocks;
  at::Tensor partial_w = at::empty({blocks, cols}, summed.options().dtype(at::kFloat));
  at::Tensor partial_b = at::empty_like(partial_w);
  if (rows > 0) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const size_t shared_bytes = (32 + 2 * cols) * sizeof(float);
    VIT_KERNELS_DISPATCH_CUDA_FLOATS(summed.scalar_type(), "fused_layer_norm_backward_cuda", [&] {
      const scalar_t* w = optional_ptr<scalar_t>(weight);
      const scalar_t* dsum = optional_ptr<scalar_t>(grad_summed);
      constexpr int kPack = Pack<scalar_t>::kSize;
      const bool vectorised =
          packs_fit<scalar_t>(cols, {grad_out.data_ptr(), dsum, summed.data_ptr(), w, ds.data_ptr()});
      auto launch = [&](auto kernel, int threads) {
        if (shared_bytes > 48 * 1024) {  // above the default dynamic shared memory limit: opt in
          C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(shared_bytes)));
        }
        kernel<<<blocks, threads, shared_bytes, stream>>>(
            grad_out.data_ptr<scalar_t>(), dsum, summed.data_ptr<scalar_t>(), w, mean.data_ptr<float>(),
            rstd.data_ptr<float>(), ds.data_ptr<scalar_t>(), partial_w.data_ptr<float>(), partial_b.data_ptr<float>(),
            rows, cols, rows_per_block, weight_bias_grad);
      };
      if (vectorised) {
        launch(layer_norm_bwd_kernel<scalar_t, kPack>, threads_for(cols / kPack, 512));
      } else {
        launch(layer_norm_bwd_kernel<scalar_t, 1>, threads_for(cols, 512));
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  if (!weight_bias_grad || rows == 0) {
    at::Tensor none = at::zeros({weight_bias_grad ? cols : 0}, summed.options().dtype(at::kFloat));
    return {ds, none, none.clone()};
  }
  return {ds, partial_w.sum(0), partial_b.sum(0)};
}

TORCH_LIBRARY_IMPL(vit_kernels, CUDA, m) {
  m.impl("fused_layer_norm", &fused_layer_norm_cuda);
  m.impl("fused_layer_norm_backward", &fused_layer_norm_backward_cuda);
}

}  // namespace vit_kernels::cuda
