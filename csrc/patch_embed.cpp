// Patchify (vit_kernels::patchify: im2col for a stride = kernel = P convolution) and its adjoint, on
// the CPU: the extension's patch_embed is patchify + GEMM + class token / position embedding.
//
//   patches[n, ph * Wp + pw, (c * P + i) * P + j] = images[n, c, ph * P + i, pw * P + j]
// with Hp = H / P, Wp = W / P (floored, as Conv2d does). Images may be NCHW or channels_last: they
// are read through their strides. Patches do not overlap, so the adjoint (unpatchify) is a scatter
// with no accumulation; pixels no patch reaches get zero gradient.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "checks.h"

namespace vit_kernels {

constexpr const char* kPatchify = "vit_kernels::patchify";
constexpr const char* kUnpatchify = "vit_kernels::unpatchify";

// Checks shared with the CUDA kernels; returns (N, C, H, W).
std::array<int64_t, 4> check_patchify_args(const at::Tensor& images, int64_t patch_size, bool cpu) {
  TORCH_CHECK(images.dim() == 4, kPatchify, ": images must have shape (N, C, H, W), got ", images.sizes());
  check_float_dtype(kPatchify, "images", images, cpu);
  TORCH_CHECK(images.is_contiguous() || images.is_contiguous(at::MemoryFormat::ChannelsLast), kPatchify,
              ": images must be contiguous NCHW or channels_last, got strides ", images.strides());
  TORCH_CHECK(patch_size > 0, kPatchify, ": patch_size must be positive, got ", patch_size);
  TORCH_CHECK(images.size(2) >= patch_size && images.size(3) >= patch_size, kPatchify, ": images of ",
              images.size(2), "x", images.size(3), " are smaller than one ", patch_size, "x", patch_size, " patch");
  return {images.size(0), images.size(1), images.size(2), images.size(3)};
}

void check_unpatchify_args(const at::Tensor& patches, int64_t channels, int64_t height, int64_t width,
                           int64_t patch_size, bool cpu) {
  TORCH_CHECK(patch_size > 0 && channels > 0 && height >= patch_size && width >= patch_size, kUnpatchify,
              ": need channels > 0 and height, width >= patch_size > 0, got channels=", channels, " height=", height,
              " width=", width, " patch_size=", patch_size);
  const int64_t tokens = (height / patch_size) * (width / patch_size);
  const int64_t columns = channels * patch_size * patch_size;
  TORCH_CHECK(patches.dim() == 3 && patches.size(1) == tokens && patches.size(2) == columns, kUnpatchify,
              ": patches must have shape (N, ", tokens, ", ", columns, ") for ", channels, "x", height, "x", width,
              " images and ", patch_size, "x", patch_size, " patches, got ", patches.sizes());
  check_float_dtype(kUnpatchify, "patches", patches, cpu);
  check_contiguous(kUnpatchify, "patches", patches);
}

namespace cpu {

at::Tensor patchify_cpu(const at::Tensor& images, int64_t patch_size) {
  const auto [n_images, channels, height, width] = check_patchify_args(images, patch_size, /*cpu=*/true);
  const int64_t P = patch_size, grid_w = width / P, tokens = (height / P) * grid_w, columns = channels * P * P;
  at::Tensor patches = at::empty({n_images, tokens, columns}, images.options());
  const int64_t sn = images.stride(0), sc = images.stride(1), sh = images.stride(2), sw = images.stride(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, images.scalar_type(), "patchify_cpu", [&] {
    const scalar_t* src = images.data_ptr<scalar_t>();
    scalar_t* dst = patches.data_ptr<scalar_t>();
    at::parallel_for(0, n_images * tokens, std::max<int64_t>(1, 4096 / columns), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t n = row / tokens, t = row % tokens;
        const scalar_t* origin = src + n * sn + (t / grid_w) * P * sh + (t % grid_w) * P * sw;
        scalar_t* out = dst + row * columns;
        for (int64_t c = 0; c < channels; ++c)
          for (int64_t i = 0; i < P; ++i)
            for (int64_t j = 0; j < P; ++j) *out++ = origin[c * sc + i * sh + j * sw];
      }
    });
  });
  return patches;
}

at::Tensor unpatchify_cpu(const at::Tensor& patches, int64_t channels, int64_t height, int64_t width,
                          int64_t patch_size) {
  check_unpatchify_args(patches, channels, height, width, patch_size, /*cpu=*/true);
  TORCH_CHECK(patches.device().is_cpu(), kUnpatchify, ": expected CPU tensors here, got ", patches.device());
  const int64_t P = patch_size, grid_w = width / P, tokens = patches.size(1), columns = patches.size(2);
  const int64_t n_images = patches.size(0);
  const bool covers_all = height % P == 0 && width % P == 0;
  at::Tensor images = covers_all ? at::empty({n_images, channels, height, width}, patches.options())
                                 : at::zeros({n_images, channels, height, width}, patches.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, patches.scalar_type(), "unpatchify_cpu", [&] {
    const scalar_t* src = patches.data_ptr<scalar_t>();
    scalar_t* dst = images.data_ptr<scalar_t>();
    at::parallel_for(0, n_images * tokens, std::max<int64_t>(1, 4096 / columns), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const int64_t n = row / tokens, t = row % tokens;
        scalar_t* origin = dst + ((n * channels) * height + (t / grid_w) * P) * width + (t % grid_w) * P;
        const scalar_t* in = src + row * columns;
        for (int64_t c = 0; c < channels; ++c)
          for (int64_t i = 0; i < P; ++i)
            for (int64_t j = 0; j < P; ++j) origin[(c * height + i) * width + j] = *in++;
      }
    });
  });
  return images;
}

TORCH_LIBRARY_IMPL(vit_kernels, CPU, m) {
  m.impl("patchify", &patchify_cpu);
  m.impl("unpatchify", &unpatchify_cpu);
}

}  // namespace cpu
}  // namespace vit_kernels
