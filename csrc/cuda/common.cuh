// Helpers shared by the CUDA kernels: 16-byte packs, warp/block sums, launch set-up on the current
// stream. Only the CUDA runtime and c10/cuda headers are used (no cuBLAS / cuSPARSE headers).
#pragma once

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/types.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "../checks.h"

namespace vit_kernels::cuda {

// A 16-byte vector of scalars: 4 floats or 8 halves / bfloat16s, loaded and stored in one transaction.
template <typename scalar_t>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(scalar_t);
  scalar_t v[kSize];
};

// Whether every pointer is 16-byte aligned and a row of `cols` holds whole packs.
template <typename scalar_t>
inline bool packs_fit(int64_t cols, std::initializer_list<const void*> pointers) {
  if (cols % Pack<scalar_t>::kSize != 0) return false;
  for (const void* p : pointers)
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

// Sum over the block; every thread gets the total. `scratch` holds 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = (blockDim.x + 31) / 32;
  value = warp_sum(value);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  value = lane < warps ? scratch[lane] : 0.0f;
  return warp_sum(value);
}

// Threads per block for a row of `units` work items: whole warps, between 32 and `cap`.
inline int threads_for(int64_t units, int cap) {
  const int64_t warps = (units + 31) / 32;
  return static_cast<int>(std::min<int64_t>(cap, std::max<int64_t>(32, warps * 32)));
}

inline int multiprocessor_count(int device) {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Blocks of `kernel` resident per multiprocessor of `device` at `threads` threads and `shared_bytes`
// of dynamic shared memory. The runtime's answer never changes for these arguments and costs
// microseconds to ask, so it is asked once per (device, kernel, threads, shared bytes).
template <typename Kernel>
int resident_blocks(int device, Kernel kernel, int threads, size_t shared_bytes) {
  using Key = std::tuple<int, const void*, int, size_t>;
  static std::mutex mutex;
  static std::map<Key, int> known;
  const Key key{device, reinterpret_cast<const void*>(kernel), threads, shared_bytes};
  std::lock_guard<std::mutex> lock(mutex);
  const auto found = known.find(key);
  if (found != known.end()) return found->second;
  int resident = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, threads, shared_bytes));
  known.emplace(key, resident);
  return resident;
}

inline void check_cuda_input(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor here, got ", t.device());
  check_float_dtype(op, name, t, /*allow_double=*/false);
}

// float32, float16 and bfloat16 only (float64 is a CPU-side testing dtype).
#define VIT_KERNELS_DISPATCH_CUDA_FLOATS(TYPE, NAME, ...)                                      \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                    \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)                 \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

}  // namespace vit_kernels::cuda
