// Bias + GELU (vit_kernels::bias_gelu), the epilogue of linear_gelu (and of mlp's fc1) after a cuBLAS
// GEMM, forward and backward, on CUDA.
//
//   z = x + bias (per column),  y = gelu(z) = 0.5 z (1 + erf(z / sqrt 2))
//   tanh form: y = 0.5 z (1 + tanh(u)), u = sqrt(2/pi) (z + 0.044715 z^3)
//   quick form: y = z s, s = sigmoid(1.702 z)
//   backward: dz = dy * gelu'(z), gelu'(z) = Phi(z) + z phi(z)
//             (tanh form: 0.5 (1 + t) + 0.5 z (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 z^2), t = tanh u;
//              quick form: s + 1.702 z s (1 - s))
//             d bias = sum_rows dz (float32), reduced in the same pass: the pass that writes dz
//             reads nothing twice (PyTorch's GELU backward, then a sum over dz, reads dz again)
// Forward: element-wise over the flat tensor, a 16-byte pack per thread per step (grid-stride loop).
// Backward: 2-D, see bias_gelu_backward_kernel.

#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <type_traits>

#include "common.cuh"

namespace vit_kernels::cuda {
namespace {

constexpr const char* kForward = "vit_kernels::bias_gelu";
constexpr const char* kBackward = "vit_kernels::bias_gelu_backward";

// (1 + tanh u, 1 - tanh^2 u) without cancellation where tanh u nears -1 or 1: with e = exp(-2|u|)
// in [0, 1], 1 + tanh u = 2 / (1 + e) for u >= 0 and 2e / (1 + e) below, 1 - tanh^2 u = 4e / (1 + e)^2.
struct TanhTerms {
  float one_plus_t, sech2;
};

__device__ __forceinline__ TanhTerms tanh_terms(float u) {
  const float e = expf(-2.0f * fabsf(u));
  const float inv = 1.0f / (1.0f + e);
  return {u >= 0.0f ? 2.0f * inv : 2.0f * e * inv, 4.0f * e * inv * inv};
}

__device__ __forceinline__ float tanh_gelu_arg(float z) {
  return 0.7978845608028654f * (z + 0.044715f * z * z * z);
}

// quick form's derivative from one e = exp(-1.702 |z|) in [0, 1]: s = 1 / (1 + e) for z >= 0 and
// e / (1 + e) below, s (1 - s) = e / (1 + e)^2, without cancellation or overflow.
template <int kForm>
__device__ __forceinline__ float gelu(float z) {
  if constexpr (kForm == kGeluTanh) {
    return 0.5f * z * tanh_terms(tanh_gelu_arg(z)).one_plus_t;
  } else if constexpr (kForm == kGeluQuick) {
    return z / (1.0f + expf(-static_cast<float>(kQuickGeluSlope) * z));
  } else {
    return 0.5f * z * (1.0f + erff(z * 0.7071067811865476f));
  }
}

template <int kForm>
__device__ __forceinline__ float gelu_grad(float z) {
  if constexpr (kForm == kGeluTanh) {
    const TanhTerms t = tanh_terms(tanh_gelu_arg(z));
    return 0.5f * t.one_plus_t + 0.5f * z * t.sech2 * 0.7978845608028654f * (1.0f + 0.134145f * z * z);
  } else if constexpr (kForm == kGeluQuick) {
    constexpr float kSlope = static_cast<float>(kQuickGeluSlope);
    const float e = expf(-kSlope * fabsf(z));
    const float inv = 1.0f / (1.0f + e);
    return (z >= 0.0f ? inv : e * inv) + kSlope * z * e * inv * inv;
  } else {
    return 0.5f * (1.0f + erff(z * 0.7071067811865476f)) + z * 0.3989422804014327f * expf(-0.5f * z * z);
  }
}

// Forward: out = gelu(x + b), a 16-byte pack per thread per grid-stride step.
template <typename scalar_t, int kVec, int kForm>
__global__ void bias_gelu_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ bias,
                                 scalar_t* __restrict__ out, int64_t numel, int64_t cols) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kVec;
  for (int64_t start = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec; start < numel;
       start += stride) {
    // kVec > 1 only when cols is a multiple of kVec, so a pack never crosses a row.
    const int64_t col = start % cols;
    Pack<scalar_t> xs, bs, result;
    if constexpr (kVec > 1) {
      xs = *reinterpret_cast<const Pack<scalar_t>*>(x + start);
      if (bias != nullptr) bs = *reinterpret_cast<const Pack<scalar_t>*>(bias + col);
    } else {
      xs.v[0] = x[start];
      if (bias != nullptr) bs.v[0] = bias[col];
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float z = static_cast<float>(xs.v[k]) + (bias != nullptr ? static_cast<float>(bs.v[k]) : 0.0f);
      result.v[k] = static_cast<scalar_t>(gelu<kForm>(z));
    }
    if constexpr (kVec > 1) {
      *reinterpret_cast<Pack<scalar_t>*>(out + start) = result;
    } else {
      out[start] = result.v[0];
    }
  }
}

// Backward with the bias gradient. Block (32, kRowThreads): threadIdx.x walks a 16-byte pack of
// columns (32 packs = one column tile of 32 * kVec columns, blockIdx.x), threadIdx.y every
// kRowThreads-th row of the block's slice of rows (blockIdx.y). Each thread keeps float32 sums of its
// pack's dz; the block adds its kRowThreads partial sums in shared memory and writes one row of
// partial[slices, cols], summed over the slices by the caller (a small, deterministic reduction).
constexpr int kRowThreads = 8;

template <typename scalar_t, int kVec, int kForm, bool kBiasGrad>
__global__ void __launch_bounds__(32 * kRowThreads)
    bias_gelu_backward_kernel(const scalar_t* __restrict__ x, const scalar_t* __restrict__ bias,
                              const scalar_t* __restrict__ grad_out, scalar_t* __restrict__ dz,
                              float* __restrict__ partial, int64_t rows, int64_t cols, int64_t rows_per_slice) {
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x) * kVec;
  const bool active = col < cols;  // kVec > 1 only when cols is a multiple of kVec: no pack straddles
  const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_slice;
  const int64_t row_end = std::min(rows, row_begin + rows_per_slice);
  float b[kVec], sums[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) b[k] = 0.0f, sums[k] = 0.0f;
  if (active && bias != nullptr) {
    if constexpr (kVec > 1) {
      const Pack<scalar_t> bs = *reinterpret_cast<const Pack<scalar_t>*>(bias + col);
#pragma unroll
      for (int k = 0; k < kVec; ++k) b[k] = static_cast<float>(bs.v[k]);
    } else {
      b[0] = static_cast<float>(bias[col]);
    }
  }
  if (active) {
    for (int64_t row = row_begin + threadIdx.y; row < row_end; row += kRowThreads) {
      const int64_t at = row * cols + col;
      Pack<scalar_t> xs, dys, result;
      if constexpr (kVec > 1) {
        xs = *reinterpret_cast<const Pack<scalar_t>*>(x + at);
        dys = *reinterpret_cast<const Pack<scalar_t>*>(grad_out + at);
      } else {
        xs.v[0] = x[at];
        dys.v[0] = grad_out[at];
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float value = static_cast<float>(dys.v[k]) * gelu_grad<kForm>(static_cast<float>(xs.v[k]) + b[k]);
        result.v[k] = static_cast<scalar_t>(value);
        if constexpr (kBiasGrad) sums[k] += value;
      }
      if constexpr (kVec > 1) {
        *reinterpret_cast<Pack<scalar_t>*>(dz + at) = result;
      } else {
        dz[at] = result.v[0];
      }
    }
  }
  if constexpr (kBiasGrad) {
    __shared__ float block_sums[kRowThreads][32 * kVec];
#pragma unroll
    for (int k = 0; k < kVec; ++k) block_sums[threadIdx.y][threadIdx.x * kVec + k] = sums[k];
    __syncthreads();
    // The block's 32 * kVec columns, each summed over its kRowThreads partial sums by one thread.
    for (int c = threadIdx.y * 32 + threadIdx.x; c < 32 * kVec; c += 32 * kRowThreads) {
      const int64_t out_col = static_cast<int64_t>(blockIdx.x) * 32 * kVec + c;
      if (out_col >= cols) continue;
      float total = 0.0f;
#pragma unroll
      for (int r = 0; r < kRowThreads; ++r) total += block_sums[r][c];
      partial[static_cast<int64_t>(blockIdx.y) * cols + out_col] = total;
    }
  }
}

// Row slices for the backward: enough blocks for ~4 per multiprocessor, each slice a whole number of
// kRowThreads rows and at least 64 rows (a shorter one would spend more on its partial sums than on dz).
inline int64_t backward_row_slices(int64_t rows, int64_t column_tiles, int device) {
  const int64_t wanted = (4 * multiprocessor_count(device) + column_tiles - 1) / column_tiles;
  const int64_t most = std::max<int64_t>(1, rows / 64);
  return std::max<int64_t>(1, std::min<int64_t>({wanted, most, 65535}));
}

// Checks x (..., C) and bias (C,); -> the GELU form.
GeluForm check_inputs(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                  c10::string_view approximate) {
  check_cuda_input(op, "x", x);
  TORCH_CHECK(x.dim() >= 1, op, ": x must have shape (..., C), got a 0-dim tensor");
  check_contiguous(op, "x", x);
  if (bias.has_value()) check_vector(op, "bias", *bias, x, x.size(-1));
  return gelu_form(op, std::string(approximate));
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_launch(const at::Tensor& grad_out, const at::Tensor& x,
                                                             const c10::optional<at::Tensor>& bias,
                                                             c10::string_view approximate, bool bias_grad) {
  const char* op = kBackward;
  const GeluForm form = check_inputs(op, x, bias, approximate);
  check_like(op, "grad_out", grad_out, x);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor dz = at::empty_like(x);
  const int64_t cols = x.size(-1), rows = cols == 0 ? 0 : x.numel() / cols;
  const auto float_options = x.options().dtype(at::kFloat);
  if (rows == 0 || cols == 0) {
    return {dz, bias_grad ? at::zeros({cols}, float_options) : at::empty({0}, float_options)};
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor partial;
  VIT_KERNELS_DISPATCH_CUDA_FLOATS(x.scalar_type(), "bias_gelu_backward_cuda", [&] {
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    constexpr int kPack = Pack<scalar_t>::kSize;
    const bool vectorised = packs_fit<scalar_t>(cols, {x.data_ptr(), b, grad_out.data_ptr(), dz.data_ptr()});
    const int vec = vectorised ? kPack : 1;
    const int64_t column_tiles = (cols + 32 * vec - 1) / (32 * vec);
    TORCH_CHECK(column_tiles <= std::numeric_limits<int32_t>::max(), op, ": x has too many columns, ", cols);
    const int64_t slices = backward_row_slices(rows, column_tiles, x.get_device());
    const int64_t rows_per_slice = (rows + slices - 1) / slices;
    if (bias_grad) partial = at::empty({slices, cols}, float_options);
    float* partial_ptr = bias_grad ? partial.data_ptr<float>() : nullptr;
    const dim3 grid(static_cast<unsigned>(column_tiles), static_cast<unsigned>(slices));
    const dim3 block(32, kRowThreads);
    auto launch = [&](auto kernel) {
      kernel<<<grid, block, 0, stream>>>(x.data_ptr<scalar_t>(), b, grad_out.data_ptr<scalar_t>(),
                                         dz.data_ptr<scalar_t>(), partial_ptr, rows, cols, rows_per_slice);
    };
    auto launch_for = [&](auto vec_tag) {
      constexpr int kVec = decltype(vec_tag)::value;
      with_gelu_form(form, [&](auto form_tag) {
        constexpr int kForm = decltype(form_tag)::value;
        bias_grad ? launch(bias_gelu_backward_kernel<scalar_t, kVec, kForm, true>)
                  : launch(bias_gelu_backward_kernel<scalar_t, kVec, kForm, false>);
      });
    };
    vectorised ? launch_for(std::integral_constant<int, kPack>{}) : launch_for(std::integral_constant<int, 1>{});
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (!bias_grad) return {dz, at::empty({0}, float_options)};
  return {dz, partial.size(0) == 1 ? partial[0] : partial.sum(0)};
}

at::Tensor bias_gelu_launch(const at::Tensor& x, const c10::optional<at::Tensor>& bias, c10::string_view approximate) {
  const GeluForm form = check_inputs(kForward, x, bias, approximate);
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x);
  const int64_t numel = x.numel(), cols = x.size(-1);
  if (numel == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int blocks_cap = 8 * multiprocessor_count(x.get_device());
  VIT_KERNELS_DISPATCH_CUDA_FLOATS(x.scalar_type(), "bias_gelu_cuda", [&] {
    const scalar_t* b = bias.has_value() ? bias->data_ptr<scalar_t>() : nullptr;
    constexpr int kPack = Pack<scalar_t>::kSize;
    const bool vectorised = packs_fit<scalar_t>(cols, {x.data_ptr(), b, out.data_ptr()});
    const int64_t units = vectorised ? numel / kPack : numel;
    const int threads = 256;
    const int blocks = static_cast<int>(std::min<int64_t>(blocks_cap, (units + threads - 1) / threads));
    auto launch = [&](auto kernel) {
      kernel<<<blocks, threads, 0, stream>>>(x.data_ptr<scalar_t>(), b, out.data_ptr<scalar_t>(), numel, cols);
    };
    with_gelu_form(form, [&](auto form_tag) {
      constexpr int kForm = decltype(form_tag)::value;
      vectorised ? launch(bias_gelu_kernel<scalar_t, kPack, kForm>) : launch(bias_gelu_kernel<scalar_t, 1, kForm>);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

at::Tensor bias_gelu_cuda(const at::Tensor& x, const c10::optional<at::Tensor>& bias, c10::string_view approximate) {
  return bias_gelu_launch(x, bias, approximate);
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                           const c10::optional<at::Tensor>& bias,
                                                           c10::string_view approximate, bool bias_grad) {
  return bias_gelu_backward_launch(grad_out, x, bias, approximate, bias_grad);
}

TORCH_LIBRARY_IMPL(vit_kernels, CUDA, m) {
  m.impl("bias_gelu", &bias_gelu_cuda);
  m.impl("bias_gelu_backward", &bias_gelu_backward_cuda);
}

}  // namespace vit_kernels::cuda
