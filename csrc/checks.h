// Argument checks shared by the CPU and CUDA kernels: every failure is a TORCH_CHECK whose message
// names the op, the argument and what was expected (device, dtype, shape, contiguity).
#pragma once

#include <torch/types.h>

#include <string>
#include <type_traits>

#include "gelu_forms.h"

namespace vit_kernels {

inline void check_float_dtype(const char* op, const char* name, const at::Tensor& t, bool allow_double) {
  const auto dtype = t.scalar_type();
  const bool ok = dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 ||
                  (allow_double && dtype == at::kDouble);
  TORCH_CHECK(ok, op, ": ", name, " must be float32, float16 or bfloat16", allow_double ? " (or float64 on CPU)" : "",
              ", got ", dtype);
}

inline void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous, got shape ", t.sizes(), " with strides ",
              t.strides(), " (call .contiguous() first)");
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& reference) {
  TORCH_CHECK(t.device() == reference.device(), op, ": ", name, " is on ", t.device(), " but the input is on ",
              reference.device());
}

inline void check_same_dtype(const char* op, const char* name, const at::Tensor& t, const at::Tensor& reference) {
  TORCH_CHECK(t.scalar_type() == reference.scalar_type(), op, ": ", name, " has dtype ", t.scalar_type(),
              " but the input has ", reference.scalar_type());
}

inline void check_same_shape(const char* op, const char* name, const at::Tensor& t, const at::Tensor& reference) {
  TORCH_CHECK(t.sizes() == reference.sizes(), op, ": ", name, " must have the input's shape ", reference.sizes(),
              ", got ", t.sizes());
}

// A companion tensor (residual, gradient, ...) must match the input in device, dtype, shape and be contiguous.
inline void check_like(const char* op, const char* name, const at::Tensor& t, const at::Tensor& reference) {
  check_same_device(op, name, t, reference);
  check_same_dtype(op, name, t, reference);
  check_same_shape(op, name, t, reference);
  check_contiguous(op, name, t);
}

// A per-column vector (weight, bias) of length `columns`, on the input's device and dtype.
inline void check_vector(const char* op, const char* name, const at::Tensor& t, const at::Tensor& reference,
                         int64_t columns) {
  check_same_device(op, name, t, reference);
  check_same_dtype(op, name, t, reference);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == columns, op, ": ", name, " must have shape (", columns, ",), got ",
              t.sizes());
  check_contiguous(op, name, t);
}

// The rows x columns view of a contiguous (..., columns) tensor.
inline int64_t row_count(const at::Tensor& t) { return t.dim() == 0 ? 1 : t.numel() / std::max<int64_t>(t.size(-1), 1); }

inline GeluForm gelu_form(const char* op, const std::string& approximate) {
  TORCH_CHECK(approximate == "none" || approximate == "tanh" || approximate == "quick", op,
              ": approximate must be 'none', 'tanh' or 'quick', got '", approximate, "'");
  return approximate == "tanh" ? kGeluTanh : approximate == "quick" ? kGeluQuick : kGeluErf;
}

// Calls fn(std::integral_constant<int, form>{}) for the runtime `form`: one template instance per form.
template <typename Fn>
inline void with_gelu_form(GeluForm form, Fn&& fn) {
  switch (form) {
    case kGeluTanh: fn(std::integral_constant<int, kGeluTanh>{}); break;
    case kGeluQuick: fn(std::integral_constant<int, kGeluQuick>{}); break;
    default: fn(std::integral_constant<int, kGeluErf>{});
  }
}

}  // namespace vit_kernels

namespace vit_kernels {
// Defined in layer_norm.cpp, shared with cuda/layer_norm.cu.
void check_layer_norm_args(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                           const c10::optional<at::Tensor>& weight, const c10::optional<at::Tensor>& bias, bool cpu);
void check_layer_norm_backward_args(const at::Tensor& grad_out, const c10::optional<at::Tensor>& grad_summed,
                                    const at::Tensor& summed, const c10::optional<at::Tensor>& weight,
                                    const at::Tensor& mean, const at::Tensor& rstd, bool cpu);

// Defined in patch_embed.cpp, shared with cuda/patch_embed.cu.
std::array<int64_t, 4> check_patchify_args(const at::Tensor& images, int64_t patch_size, bool cpu);
void check_unpatchify_args(const at::Tensor& patches, int64_t channels, int64_t height, int64_t width,
                           int64_t patch_size, bool cpu);
}  // namespace vit_kernels
