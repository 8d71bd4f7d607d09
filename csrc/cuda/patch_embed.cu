// Patchify (vit_kernels::patchify: im2col for a stride = kernel = P convolution) and its adjoint, on
// CUDA: the extension's patch_embed is patchify + GEMM + class token / position embedding.
//
//   patches[n, ph * Wp + pw, (c * P + i) * P + j] = images[n, c, ph * P + i, pw * P + j]
// One thread per patch element: writes (patchify) or reads (unpatchify) of the patch matrix are
// coalesced; the image side is read through its strides (NCHW or channels_last). Patches do not
// overlap, so unpatchify scatters without atomics.

#include <torch/library.h>

#include "common.cuh"

namespace vit_kernels::cuda {
namespace {

struct Geometry {
  int64_t tokens, columns, grid_w, patch, channels;
};

// Offset (in elements) of patch element `index` in an image with strides (sn, sc, sh, sw).
__device__ __forceinline__ int64_t image_offset(int64_t index, const Geometry& g, int64_t sn, int64_t sc, int64_t sh,
                                                int64_t sw) {
  const int64_t column = index % g.columns;
  const int64_t row = index / g.columns;
  const int64_t n = row / g.tokens, t = row % g.tokens;
  const int64_t c = column / (g.patch * g.patch), i = (column / g.patch) % g.patch, j = column % g.patch;
  return n * sn + c * sc + ((t / g.grid_w) * g.patch + i) * sh + ((t % g.grid_w) * g.patch + j) * sw;
}

template <typename scalar_t>
__global__ void patchify_kernel(const scalar_t* __restrict__ images, scalar_t* __restrict__ patches, int64_t numel,
                                Geometry g, int64_t sn, int64_t sc, int64_t sh, int64_t sw) {
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < numel;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x)
    patches[index] = images[image_offset(index, g, sn, sc, sh, sw)];
}

template <typename scalar_t>
__global__ void unpatchify_kernel(const scalar_t* __restrict__ patches, scalar_t* __restrict__ images, int64_t numel,
                                  Geometry g, int64_t sn, int64_t sc, int64_t sh, int64_t sw) {
  for (int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; index < numel;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x)
    images[image_offset(index, g, sn, sc, sh, sw)] = patches[index];
}

int grid_for(int64_t numel, int device) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((numel + 255) / 256, 16 * multiprocessor_count(device))));
}

}  // namespace

at::Tensor patchify_cuda(const at::Tensor& images, int64_t patch_size) {
  const auto [n_images, channels, height, width] = check_patchify_args(images, patch_size, /*cpu=*/false);
  check_cuda_input("vit_kernels::patchify", "images", images);
  const c10::cuda::CUDAGuard guard(images.device());
  const Geometry g{(height / patch_size) * (width / patch_size), channels * patch_size * patch_size,
                   width / patch_size, patch_size, channels};
  at::Tensor patches = at::empty({n_images, g.tokens, g.columns}, images.options());
  const int64_t numel = patches.numel();
  if (numel == 0) return patches;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  VIT_KERNELS_DISPATCH_CUDA_FLOATS(images.scalar_type(), "patchify_cuda", [&] {
    patchify_kernel<scalar_t><<<grid_for(numel, images.get_device()), 256, 0, stream>>>(
        images.data_ptr<scalar_t>(), patches.data_ptr<scalar_t>(), numel, g, images.stride(0), images.stride(1),
        images.stride(2), images.stride(3));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return patches;
}

at::Tensor unpatchify_cuda(const at::Tensor& patches, int64_t channels, int64_t height, int64_t width,
                           int64_t patch_size) {
  check_unpatchify_args(patches, channels, height, width, patch_size, /*cpu=*/false);
  check_cuda_input("vit_kernels::unpatchify", "patches", patches);
  const c10::cuda::CUDAGuard guard(patches.device());
  const bool covers_all = height % patch_size == 0 && width % patch_size == 0;
  const auto shape = std::vector<int64_t>{patches.size(0), channels, height, width};
  at::Tensor images = covers_all ? at::empty(shape, patches.options()) : at::zeros(shape, patches.options());
  const Geometry g{patches.size(1), patches.size(2), width / patch_size, patch_size, channels};
  const int64_t numel = patches.numel();
  if (numel == 0) return images;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  VIT_KERNELS_DISPATCH_CUDA_FLOATS(patches.scalar_type(), "unpatchify_cuda", [&] {
    unpatchify_kernel<scalar_t><<<grid_for(numel, patches.get_device()), 256, 0, stream>>>(
        patches.data_ptr<scalar_t>(), images.data_ptr<scalar_t>(), numel, g, images.stride(0), images.stride(1),
        images.stride(2), images.stride(3));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return images;
}

TORCH_LIBRARY_IMPL(vit_kernels, CUDA, m) {
  m.impl("patchify", &patchify_cuda);
  m.impl("unpatchify", &unpatchify_cuda);
}

}  // namespace vit_kernels::cuda
