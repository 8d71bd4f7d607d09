// LayerNorm with an optional fused residual add, forward and backward, on CUDA.
//
//   s = x + residual,  mean = sum(s) / C,  rstd = 1 / sqrt(sum((s - mean)^2) / C + eps)
//   y = (s - mean) * rstd * weight + bias
// backward, with xhat = (s - mean) * rstd and g = dy * weight:
//   ds = rstd * (g - mean(g) - xhat * mean(g * xhat)) + d(s) from outside
//   dweight = sum_rows(dy * xhat),  dbias = sum_rows(dy)
// Every sum is float32; 16-bit values are converted on load and rounded once on store.
// Forward: one block per row; the row of s is kept in shared memory (fp32) between the passes, so
// x and residual are read once. Backward, two kernels: pass 1 visits each row once (dy and s read
// once, ds written), each block walking a contiguous chunk of rows with its columns' dweight / dbias
// in registers, and writes one float32 row of partial sums per block; pass 2 adds the blocks' rows in
// a fixed order. No atomics: the same inputs give the same bits on every run.

#include <torch/library.h>

#include "common.cuh"

namespace vit_kernels::cuda {
namespace {

constexpr const char* kForward = "vit_kernels::fused_layer_norm";
constexpr const char* kBackward = "vit_kernels::fused_layer_norm_backward";
// The forward keeps a float32 row in shared memory: 8192 columns are 32 KiB, within the default
// 48 KiB. The backward holds a row in registers: kMaxBackwardThreads threads x 16 columns each.
constexpr int64_t kMaxColumns = 8192;
constexpr int kMaxBackwardThreads = 512;

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

// Backward, pass 1. A thread owns the same kIters * kVec
// columns in every row it visits (columns (threadIdx.x + i * blockDim.x) * kVec, i < kIters), so its
// share of dweight / dbias (and its weight, when few columns) stay in float32 registers for the whole
// block; the R =
// blockDim.y row groups of a block walk the block's rows R at a time. Each row's two sums (of g and
// g * xhat) are reduced over its row group; ds is written in the same visit (one read of dy and s).
// At the end the row groups' partial dweight / dbias are added in a fixed order (group 0, 1, ...)
// and stored as row blockIdx.x of the float32 workspace: deterministic, no atomics.
template <typename scalar_t, int kVec, int kIters>
__global__ void __launch_bounds__(kMaxBackwardThreads)
    layer_norm_bwd_kernel(const scalar_t* __restrict__ grad_out, const scalar_t* __restrict__ grad_summed,
                          const scalar_t* __restrict__ summed, const scalar_t* __restrict__ weight,
                          const float* __restrict__ mean, const float* __restrict__ rstd, scalar_t* __restrict__ ds,
                          float* __restrict__ partial_w, float* __restrict__ partial_b, int64_t rows, int64_t cols,
                          int64_t rows_per_block, bool weight_bias_grad) {
  extern __shared__ float combine[];  // 2 * cols floats when blockDim.y > 1: the row groups' sums
  __shared__ float scratch[2][kMaxBackwardThreads / 32][2];  // per-warp (sum g, sum g * xhat), double-buffered
  const int warps_per_row = blockDim.x / 32, lane = threadIdx.x % 32;
  const int warp = threadIdx.y * warps_per_row + threadIdx.x / 32;
  const float inv_cols = 1.0f / static_cast<float>(cols);

  // The weight stays in registers where a thread's columns are few; wider rows reload it each row
  // (from L1 / L2: C elements per row against the 3 * C that come from memory), which keeps the
  // 16-column variants within the register file without spilling.
  constexpr bool kKeepWeight = kIters * kVec <= 8;
  constexpr bool kKeepRow = kIters <= 8;
  float kept_w[kKeepWeight ? kIters : 1][kVec], acc_w[kIters][kVec], acc_b[kIters][kVec];
#pragma unroll
  for (int i = 0; i < kIters; ++i) {
    if constexpr (kKeepWeight) {
      const int64_t col = (threadIdx.x + static_cast<int64_t>(i) * blockDim.x) * kVec;
      if (weight != nullptr && col < cols) {
        load<scalar_t, kVec>(weight, col, kept_w[i]);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) kept_w[i][k] = 1.0f;
      }
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc_w[i][k] = acc_b[i][k] = 0.0f;
  }

  const int64_t first = blockIdx.x * rows_per_block;
  const int64_t last = min(rows, first + rows_per_block);
  int parity = 0;
  // The trip count is the same for every thread of the block (the row-group reduction synchronises).
  for (int64_t base = first; base < last; base += blockDim.y, parity ^= 1) {
    const int64_t row = base + threadIdx.y;
    const bool valid = row < last;
    const scalar_t* s_row = summed + row * cols;
    const scalar_t* dy_row = grad_out + row * cols;
    const float mu = valid ? mean[row] : 0.0f, inv = valid ? rstd[row] : 0.0f;
    // Out-of-range columns and rows hold dy = 0, s = mean (xhat = 0): they add nothing to any sum. xhat and
    // g = dy * w stay in registers until ds is written, except in the 16-column scalar variant,
    // which reloads its row (from L1) for ds rather than spill.
    float xhat[kKeepRow ? kIters : 1][kVec], g[kKeepRow ? kIters : 1][kVec];
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int64_t col = (threadIdx.x + static_cast<int64_t>(i) * blockDim.x) * kVec;
      const bool in = valid && col < cols;
      float dy[kVec], w[kVec];
      float(&xh)[kVec] = xhat[kKeepRow ? i : 0];
      float(&gi)[kVec] = g[kKeepRow ? i : 0];
      if (in) {
        load<scalar_t, kVec>(s_row, col, xh);
        load<scalar_t, kVec>(dy_row, col, dy);
      } else {  // s = mean, dy = 0: xhat = 0 exactly, even where |mean| * rstd overflows (0 * inf is NaN)
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          xh[k] = mu;
          dy[k] = 0.0f;
        }
      }
      if constexpr (kKeepWeight) {
#pragma unroll
        for (int k = 0; k < kVec; ++k) w[k] = kept_w[i][k];
      } else if (weight != nullptr && in) {
        load<scalar_t, kVec>(weight, col, w);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) w[k] = 1.0f;
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        xh[k] = (xh[k] - mu) * inv;
        gi[k] = dy[k] * w[k];
        sum_g += gi[k];
        sum_gx += gi[k] * xh[k];
        acc_w[i][k] += dy[k] * xh[k];
        acc_b[i][k] += dy[k];
      }
    }
    // Sum over the row group: warp shuffles, then the group's warps in order through shared memory.
    // Alternating buffers make one barrier per row enough: a buffer is rewritten two rows later, after
    // every thread has passed the barrier in between, so its previous readers are done.
    sum_g = warp_sum(sum_g);
    sum_gx = warp_sum(sum_gx);
    if (warps_per_row > 1) {
      if (lane == 0) {
        scratch[parity][warp][0] = sum_g;
        scratch[parity][warp][1] = sum_gx;
      }
      __syncthreads();
      sum_g = sum_gx = 0.0f;
      for (int j = 0; j < warps_per_row; ++j) {
        sum_g += scratch[parity][threadIdx.y * warps_per_row + j][0];
        sum_gx += scratch[parity][threadIdx.y * warps_per_row + j][1];
      }
    }
    const float c1 = sum_g * inv_cols, c2 = sum_gx * inv_cols;
#pragma unroll(kKeepRow ? kIters : 1)  // the reloading variant touches no register array here
    for (int i = 0; i < kIters; ++i) {
      const int64_t col = (threadIdx.x + static_cast<int64_t>(i) * blockDim.x) * kVec;
      if (!valid || col >= cols) continue;
      float extra[kVec], out[kVec];
      if (grad_summed != nullptr) load<scalar_t, kVec>(grad_summed + row * cols, col, extra);
      if constexpr (!kKeepRow) {  // reload s and dy; g = dy * w again
        float w[kVec];
        load<scalar_t, kVec>(s_row, col, xhat[0]);
        load<scalar_t, kVec>(dy_row, col, g[0]);
        if (weight != nullptr) load<scalar_t, kVec>(weight, col, w);
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          xhat[0][k] = (xhat[0][k] - mu) * inv;
          g[0][k] *= weight != nullptr ? w[k] : 1.0f;
        }
      }
      const float(&xh)[kVec] = xhat[kKeepRow ? i : 0];
      const float(&gi)[kVec] = g[kKeepRow ? i : 0];
#pragma unroll
      for (int k = 0; k < kVec; ++k) out[k] = inv * (gi[k] - c1 - xh[k] * c2) + (grad_summed != nullptr ? extra[k] : 0.0f);
      store<scalar_t, kVec>(ds + row * cols, col, out);
    }
  }
  if (!weight_bias_grad) return;

  // The row groups' partial sums, added in group order in shared memory; the last group stores.
  float* row_w = partial_w + blockIdx.x * cols;
  float* row_b = partial_b + blockIdx.x * cols;
  for (int group = 0; group < static_cast<int>(blockDim.y); ++group) {
    if (group > 0) __syncthreads();  // the previous group's additions are visible
    if (threadIdx.y == group) {
      const bool is_last = group + 1 == static_cast<int>(blockDim.y);
#pragma unroll
      for (int i = 0; i < kIters; ++i) {
        const int64_t col = (threadIdx.x + static_cast<int64_t>(i) * blockDim.x) * kVec;
        if (col >= cols) continue;
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float dw = group > 0 ? combine[col + k] + acc_w[i][k] : acc_w[i][k];
          const float db = group > 0 ? combine[cols + col + k] + acc_b[i][k] : acc_b[i][k];
          if (is_last) {
            row_w[col + k] = dw;
            row_b[col + k] = db;
          } else {
            combine[col + k] = dw;
            combine[cols + col + k] = db;
          }
        }
      }
    }
  }
}

// Backward, pass 2: dweight[c] = sum_b partial_w[b][c] (and dbias from partial_b, blockIdx.y = 1),
// float32, in a fixed order: slice threadIdx.y sums rows threadIdx.y, threadIdx.y + kSlices, ... in
// turn, then the slices are added in order. 32 consecutive columns per warp: coalesced loads.
constexpr int kReduceSlices = 16;

__global__ void __launch_bounds__(32 * kReduceSlices)
    layer_norm_bwd_reduce_kernel(const float* __restrict__ partial_w, const float* __restrict__ partial_b,
                                 float* __restrict__ grad_w, float* __restrict__ grad_b, int64_t blocks, int64_t cols) {
  __shared__ float slices[kReduceSlices][33];
  const float* partial = blockIdx.y == 0 ? partial_w : partial_b;
  float* out = blockIdx.y == 0 ? grad_w : grad_b;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float sum = 0.0f;
  if (col < cols)
    for (int64_t b = threadIdx.y; b < blocks; b += kReduceSlices) sum += partial[b * cols + col];
  slices[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y == 0 && col < cols) {
    float total = 0.0f;
#pragma unroll
    for (int j = 0; j < kReduceSlices; ++j) total += slices[j][threadIdx.x];
    out[col] = total;
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

// Calls f(std::integral_constant<int, kIters>) for the smallest kIters of 1, 2, 4, 8, 16 whose
// kIters * kVec <= 16 (at most 16 floats per thread per array) lets kMaxBackwardThreads threads span
// `packs` packs. kMaxColumns = 8192 is within reach of every kVec (8 * 2, 4 * 4, 1 * 16 per thread).
template <int kVec, typename F>
void with_iters(int64_t packs, F&& f) {
  auto fits = [&](int iters) { return packs <= static_cast<int64_t>(iters) * kMaxBackwardThreads; };
  if (fits(1)) return f(std::integral_constant<int, 1>{});
  if (fits(2)) return f(std::integral_constant<int, 2>{});
  if constexpr (4 * kVec <= 16) if (fits(4)) return f(std::integral_constant<int, 4>{});
  if constexpr (8 * kVec <= 16) if (fits(8)) return f(std::integral_constant<int, 8>{});
  if constexpr (16 * kVec <= 16) if (fits(16)) return f(std::integral_constant<int, 16>{});
  TORCH_CHECK(false, kBackward, ": no backward kernel for ", packs, " packs of ", kVec, " per row");
}

// Backward launch. Traffic, for R rows x C columns of scalar_t (E bytes): dy and s read once, ds
// written once, grad_summed (when given) read once: (3 or 4) * R * C * E bytes, plus the weight once
// per block and 8 bytes of statistics per row; the float32 workspace (2 * blocks * C * 4 bytes, blocks
// at most one wave of resident blocks: a few hundred on an H100) is written once by pass 1 and read
// once by pass 2. For ViT-B/16 at batch 128 in bf16 (R = 25216, C = 768): 116 MB (155 MB with
// grad_summed) against a few MB of workspace: the backward is one pass over its tensors.
// Block shape: blockDim.x = threads per row (whole warps, each thread kIters packs), blockDim.y = row
// groups, as many as fit in kMaxBackwardThreads threads (narrow rows get several rows per step).
template <typename scalar_t, int kVec>
std::tuple<at::Tensor, at::Tensor> run_backward(const at::Tensor& grad_out, const scalar_t* grad_summed,
                                                const at::Tensor& summed, const scalar_t* weight, const at::Tensor& mean,
                                                const at::Tensor& rstd, at::Tensor& ds, bool weight_bias_grad) {
  const int64_t cols = summed.size(-1), rows = row_count(summed);
  const auto float_options = summed.options().dtype(at::kFloat);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor grad_w, grad_b;
  with_iters<kVec>(cols / kVec, [&](auto iters) {
    constexpr int kIters = decltype(iters)::value;
    auto kernel = layer_norm_bwd_kernel<scalar_t, kVec, kIters>;
    const int64_t per_thread = static_cast<int64_t>(kIters) * kVec;
    const int row_threads = threads_for((cols + per_thread - 1) / per_thread, kMaxBackwardThreads);
    const int groups = static_cast<int>(std::min<int64_t>(rows, kMaxBackwardThreads / row_threads));
    // The row groups' sums meet in shared memory: 2 * cols floats, at most 2 * 256 * 16 * 4 = 32 KiB.
    const size_t shared_bytes = groups > 1 && weight_bias_grad ? 2 * cols * sizeof(float) : 0;
    const int device = summed.get_device();
    const int resident = resident_blocks(device, kernel, row_threads * groups, shared_bytes);
    const int64_t wave = std::max(1, resident) * static_cast<int64_t>(multiprocessor_count(device));
    const int64_t steps = (rows + groups - 1) / groups;  // row-group steps in all
    const int64_t blocks_wanted = std::min(steps, wave);
    const int64_t rows_per_block = ((steps + blocks_wanted - 1) / blocks_wanted) * groups;
    const int64_t blocks = (rows + rows_per_block - 1) / rows_per_block;
    at::Tensor workspace = at::empty({weight_bias_grad ? 2 : 0, blocks, cols}, float_options);
    float* partial_w = weight_bias_grad ? workspace[0].data_ptr<float>() : nullptr;
    float* partial_b = weight_bias_grad ? workspace[1].data_ptr<float>() : nullptr;
    kernel<<<static_cast<unsigned>(blocks), dim3(row_threads, groups), shared_bytes, stream>>>(
        grad_out.data_ptr<scalar_t>(), grad_summed, summed.data_ptr<scalar_t>(), weight, mean.data_ptr<float>(),
        rstd.data_ptr<float>(), ds.data_ptr<scalar_t>(), partial_w, partial_b, rows, cols, rows_per_block,
        weight_bias_grad);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (!weight_bias_grad) return;
    grad_w = at::empty({cols}, float_options);  // two tensors: the op's outputs must not alias each other
    grad_b = at::empty({cols}, float_options);
    const dim3 grid(static_cast<unsigned>((cols + 31) / 32), 2);
    layer_norm_bwd_reduce_kernel<<<grid, dim3(32, kReduceSlices), 0, stream>>>(
        partial_w, partial_b, grad_w.data_ptr<float>(), grad_b.data_ptr<float>(), blocks, cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {grad_w, grad_b};
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
  at::Tensor grad_w, grad_b;
  if (rows > 0) {
    VIT_KERNELS_DISPATCH_CUDA_FLOATS(summed.scalar_type(), "fused_layer_norm_backward_cuda", [&] {
      const scalar_t* w = optional_ptr<scalar_t>(weight);
      const scalar_t* dsum = optional_ptr<scalar_t>(grad_summed);
      constexpr int kPack = Pack<scalar_t>::kSize;
      if (packs_fit<scalar_t>(cols, {grad_out.data_ptr(), dsum, summed.data_ptr(), w, ds.data_ptr()})) {
        std::tie(grad_w, grad_b) = run_backward<scalar_t, kPack>(grad_out, dsum, summed, w, mean, rstd, ds, weight_bias_grad);
      } else {
        std::tie(grad_w, grad_b) = run_backward<scalar_t, 1>(grad_out, dsum, summed, w, mean, rstd, ds, weight_bias_grad);
      }
    });
  }
  if (!grad_w.defined()) {
    // No weight/bias gradient asked for (empty tensors), or no rows (zeros).
    at::Tensor none = at::zeros({weight_bias_grad ? cols : 0}, summed.options().dtype(at::kFloat));
    return {ds, none, none.clone()};
  }
  return {ds, grad_w, grad_b};
}

TORCH_LIBRARY_IMPL(vit_kernels, CUDA, m) {
  m.impl("fused_layer_norm", &fused_layer_norm_cuda);
  m.impl("fused_layer_norm_backward", &fused_layer_norm_backward_cuda);
}

}  // namespace vit_kernels::cuda
