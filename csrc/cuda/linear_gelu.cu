// Bias + GELU (vit_kernels::bias_gelu), the epilogue of linear_gelu (and of mlp's fc1) after a cuBLAS
// GEMM, forward and backward, on CUDA.
//
//   z = x + bias (per column),  y = gelu(z) = 0.5 z (1 + erf(z / sqrt 2))
//   tanh form: y = 0.5 z (1 + tanh(u)), u = sqrt(2/pi) (z + 0.044715 z^3)
//   backward: dz = dy * gelu'(z), gelu'(z) = Phi(z) + z phi(z)
//             (tanh form: 0.5 (1 + t) + 0.5 z (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 z^2), t = tanh u)
// Element-wise over the flat tensor, a 16-byte pack per thread per step (grid-stride loop).

#include <torch/library.h>

#include "common.cuh"

namespace vit_kernels::cuda {
namespace {

constexpr const char* kForward = "vit_kernels::bias_gelu";
constexpr const char* kBackward = "vit_kernels::bias_gelu_backward";

template <bool kTanh>
__device__ __forceinline__ float gelu(float z) {
  if constexpr (kTanh) {
    const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
    return 0.5f * z * (1.0f + tanhf(u));
  } else {
    return 0.5f * z * (1.0f + erff(z * 0.7071067811865476f));
  }
}

template <bool kTanh>
__device__ __forceinline__ float gelu_grad(float z) {
  if constexpr (kTanh) {
    const float u = 0.7978845608028654f * (z + 0.044715f * z * z * z);
    const float t = tanhf(u);
    return 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 0.134145f * z * z);
  } else {
    return 0.5f * (1.0f + erff(z * 0.7071067811865476f)) + z * 0.3989422804014327f * __expf(-0.5f * z * z);
  }
}

// grad_out == nullptr: forward (out = gelu(x + b)); else backward (out = grad_out * gelu'(x + b)).
template <typename scalar_t, int kVec, bool kTanh>
__global__ void bias_gelu_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ bias,
                                 const scalar_t* __restrict__ grad_out, scalar_t* __restrict__ out, int64_t numel,
                                 int64_t cols) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kVec;
  for (int64_t start = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; start < numel;
       start += stride) {
    // kVec > 1 only when cols is a multiple of kVec, so a pack never crosses a row.
    const int64_t col = start % cols;
    Pack<scalar_t> xs, bs, dys, result;
    if constexpr (kVec > 1) {
      xs = *reinterpret_cast<const Pack<scalar_t>*>(x + start);
      if (bias != nullptr) bs = *reinterpret_cast<const Pack<scalar_t>*>(bias + col);
      if (grad_out != nullptr) dys = *reinterpret_cast<const Pack<scalar_t>*>(grad_out + start);
    } else {
      xs.v[0] = x[start];
      if (bias != nullptr) bs.v[0] = bias[col];
      if (grad_out != nullptr) dys.v[0] = grad_out[start];
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float z = static_cast<float>(xs.v[k]) + (bias != nullptr ? static_cast<float>(bs.v[k]) : 0.0f);
      const float value = grad_out == nullptr ? gelu<kTanh>(z) : static_cast<float>(dys.v[k]) * gelu_grad<kTanh>(z);
      result.v[k] = static_cast<scalar_t>(value);
    }
    if constexpr (kVec > 1) {
      *reinterpret_cast<Pack<scalar_t>*>(out + start) = result;
    } else {
      out[start] = result.v[0];
    }
  }
}

at::Tensor bias_gelu_launch(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                            const at::Tensor* grad_out, c10::string_view approximate) {
  check_cuda_input(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have shape (..., C), got a 0-dim tensor");
  check_contiguous(op, "x", x);
  if (bias.has_value()) check_vector(op, "bias", *bias, x, x.size(-1));
  if (grad_out != nullptr) check_like(op, "grad_out", *grad_out, x);
  const bool tanh_form = gelu_is_tanh(op, std::string(approximate));
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  const int64_t numel = x.numel(), cols = x.size(-1);
  if (numel == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int blocks_cap = 8 * multiprocessor_count(x.get_device());
  VIT_KERNELS_DISPATCH_CUDA_FLOATS(x.scalar_type(), "bias_gelu_cuda", [&] {
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    const scalar_t* dy = grad_out != nullptr ? grad_out->data_ptr<scalar_t>() : nullptr;
    constexpr int kPack = Pack<scalar_t>::kSize;
    const bool vectorised = packs_fit<scalar_t>(cols, {x.data_ptr(), b, dy, out.data_ptr()});
    const int64_t units = vectorised ? numel / kPack : numel;
    const int threads = 256;
    const int blocks = static_cast<int>(std::min<int64_t>(blocks_cap, (units + threads - 1) / threads));
    auto launch = [&](auto kernel) {
      kernel<<<blocks, threads, 0, stream>>>(x.data_ptr<scalar_t>(), b, dy, out.data_ptr<scalar_t>(), numel, cols);
    };
    if (vectorised) {
      tanh_form ? launch(bias_gelu_kernel<scalar_t, kPack, true>) : launch(bias_gelu_kernel<scalar_t, kPack, false>);
    } else {
      tanh_form ? launch(bias_gelu_kernel<scalar_t, 1, true>) : launch(bias_gelu_kernel<scalar_t, 1, false>);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

at::Tensor bias_gelu_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& bias, c10::string_view approximate) {
  return bias_gelu_launch(kForward, x, bias, nullptr, approximate);
}

at::Tensor bias_gelu_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                   const c10::optional<at::Tensor>& bias, c10::string_view approximate) {
  return bias_gelu_launch(kBackward, x, bias, &grad_out, approximate);
}

TORCH_LIBRARY_IMPL(vit_kernels, CUDA, m) {
  m.impl("bias_gelu", &bias_gelu_cuda);
  m.impl("bias_gelu_backward", &bias_gelu_backward_cuda);
}

}  // namespace vit_kernels::cuda
