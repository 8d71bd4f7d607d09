// Softmax over the last dimension (vit_kernels::softmax), forward and backward, on CUDA: the attention
// probabilities of the extension's attention, one warp per row.
//
//   y = exp(x - max(x)) / sum(exp(x - max(x)))
//   backward: dx = y * (dy - sum(dy * y))
// Rows of attention probabilities are short (L = 50 to 577 for ViTs): a warp per row, several rows
// per block, three passes whose re-reads hit the L1 cache.

#include <torch/library.h>


#include "common.cuh"

namespace vit_kernels::cuda {
namespace {

constexpr const char* kForward = "vit_kernels::softmax";
constexpr const char* kBackward = "vit_kernels::softmax_backward";
constexpr int kWarpsPerBlock = 8;

template <typename scalar_t>
__global__ void softmax_fwd_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int64_t rows,
                                   int64_t cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const scalar_t* in = x + row * cols;
  scalar_t* out = y + row * cols;
  float peak = -INFINITY;
  for (int64_t col = lane; col < cols; col += 32) peak = fmaxf(peak, static_cast<float>(in[col]));
  peak = warp_max(peak);
  float total = 0.0f;
  for (int64_t col = lane; col < cols; col += 32) total += expf(static_cast<float>(in[col]) - peak);
  const float inv = 1.0f / warp_sum(total);
  for (int64_t col = lane; col < cols; col += 32)
    out[col] = static_cast<scalar_t>(expf(static_cast<float>(in[col]) - peak) * inv);
}

template <typename scalar_t>
__global__ void softmax_bwd_kernel(const scalar_t* __restrict__ dy, const scalar_t* __restrict__ y,
                                   scalar_t* __restrict__ dx, int64_t rows, int64_t cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  const int64_t offset = row * cols;
  float dot = 0.0f;
  for (int64_t col = lane; col < cols; col += 32)
    dot += static_cast<float>(dy[offset + col]) * static_cast<float>(y[offset + col]);
  dot = warp_sum(dot);
  for (int64_t col = lane; col < cols; col += 32) {
    const float p = static_cast<float>(y[offset + col]);
    dx[offset + col] = static_cast<scalar_t>(p * (static_cast<float>(dy[offset + col]) - dot));
  }
}

void check_rows(const char* op, const char* name, const at::Tensor& t) {
  check_cuda_input(op, name, t);
  TORCH_CHECK(t.dim() >= 1 && t.size(-1) > 0, op, ": ", name, " must have shape (..., C) with C > 0, got ",
              t.sizes());
  check_contiguous(op, name, t);
}

}  // namespace

at::Tensor softmax_cuda(const at::Tensor& x) {
  check_rows(kForward, "x", x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = at::empty_like(x);
  const int64_t rows = row_count(x), cols = x.size(-1);
  if (rows == 0) return y;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  VIT_KERNELS_DISPATCH_CUDA_FLOATS(x.scalar_type(), "softmax_cuda", [&] {
    softmax_fwd_kernel<scalar_t><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(x.data_ptr<scalar_t>(),
                                                                           y.data_ptr<scalar_t>(), rows, cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

at::Tensor softmax_backward_cuda(const at::Tensor& grad_out, const at::Tensor& out) {
  check_rows(kBackward, "out", out);
  check_like(kBackward, "grad_out", grad_out, out);
  const c10::cuda::CUDAGuard guard(out.device());
  at::Tensor dx = at::empty_like(out);
  const int64_t rows = row_count(out), cols = out.size(-1);
  if (rows == 0) return dx;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  VIT_KERNELS_DISPATCH_CUDA_FLOATS(out.scalar_type(), "softmax_backward_cuda", [&] {
    softmax_bwd_kernel<scalar_t><<<blocks, kWarpsPerBlock * 32, 0, stream>>>(
        grad_out.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), dx.data_ptr<scalar_t>(), rows, cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return dx;
}

TORCH_LIBRARY_IMPL(vit_kernels, CUDA, m) {
  m.impl("softmax", &softmax_cuda);
  m.impl("softmax_backward", &softmax_backward_cuda);
}

}  // namespace vit_kernels::cuda
