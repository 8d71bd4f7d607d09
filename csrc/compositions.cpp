// The extension backend's public ops that are compositions: a GEMM (cuBLAS on CUDA, oneDNN/MKL on
// the CPU) with the kernel ops around it, written in C++ (CompositeImplicitAutograd) so that an
// eager call crosses from Python once instead of once per step. Autograd comes from the ops they
// are made of (the GEMMs' own, csrc/autograd.cpp for the kernels); under torch.compile they
// decompose into those ops, the kernels staying opaque in the graph.
//
//   linear_residual(x, W, b?, R) = x W^T + (R + b)          one GEMM accumulating onto the residual
//   linear_gelu(x, W, b?, a)     = gelu_a(x W^T + b)         GEMM without bias, then bias_gelu; for
//                                  the tanh form on CUDA without gradients, one cuBLASLt GEMM with
//                                  its bias + GELU epilogue
//   mlp(x, W1, b1?, W2, b2?, a, R?) = linear_residual(linear_gelu(x, W1, b1, a), W2, b2, R)
//                                  (F.linear + R where R is absent or of another dtype: autocast)

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

namespace vit_kernels::compositions {
namespace {

using at::Tensor;
using OptionalTensor = c10::optional<at::Tensor>;

Tensor bias_gelu(const Tensor& x, const OptionalTensor& bias, c10::string_view approximate) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("vit_kernels::bias_gelu", "")
                             .typed<Tensor(const Tensor&, const OptionalTensor&, c10::string_view)>();
  return op.call(x, bias, approximate);
}

// (..., N) with the leading dimensions of x: the shape of a linear layer's output. Sizes are read as
// SymInts throughout, so that under torch.compile with dynamic shapes they stay symbolic (a plain
// size read would guard on its value and recompile per batch size).
std::vector<c10::SymInt> output_shape(const Tensor& x, const c10::SymInt& out_features) {
  auto shape = x.sym_sizes().vec();
  shape.back() = out_features;
  return shape;
}

// The rows of x (..., K) as a matrix: explicit, so that K = 0 or no rows reshape too.
c10::SymInt row_count(const Tensor& x) { return c10::multiply_integers(x.sym_sizes().slice(0, x.dim() - 1)); }

Tensor linear_residual(const Tensor& x, const Tensor& weight, const OptionalTensor& bias, const Tensor& residual) {
  const c10::SymInt rows = row_count(x), out_features = weight.sym_size(0);
  Tensor accumulator = residual.reshape_symint({rows, out_features});
  if (bias.has_value()) accumulator = accumulator + *bias;
  return at::addmm(accumulator, x.reshape_symint({rows, x.sym_size(-1)}), weight.t())
      .view_symint(output_shape(x, out_features));
}

// cuBLASLt's GELU_BIAS epilogue (at::_addmm_activation) computes the GEMM, the bias and the GELU in one
// kernel: on an H100, ViT-B/16's fc1 in bf16 took 0.206 ms against 0.295 for the GEMM and a separate
// bias + GELU pass (benchmarks/results/h100-2026-11-22.md). Its GELU is the tanh form (on CUDA; the CPU
// implementation applies the erf form) and it has no derivative: taken for the tanh form on CUDA,
// with a bias, when no gradient is needed, and K > 0 (with K = 0 CUDA's addmm returns the bias
// before any activation).
bool cublaslt_gelu_epilogue(const Tensor& x, const Tensor& weight, const OptionalTensor& bias,
                            c10::string_view approximate) {
  if (approximate != "tanh" || !x.is_cuda() || !bias.has_value() || bias->dim() != 1) return false;
  if (x.sym_size(-1) == 0) return false;
  return !(at::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad() || bias->requires_grad()));
}

Tensor linear_gelu(const Tensor& x, const Tensor& weight, const OptionalTensor& bias, c10::string_view approximate) {
  if (cublaslt_gelu_epilogue(x, weight, bias, approximate)) {
    return at::_addmm_activation(*bias, x.reshape_symint({row_count(x), x.sym_size(-1)}), weight.t(), 1, 1,
                                 /*use_gelu=*/true)
        .view_symint(output_shape(x, weight.sym_size(0)));
  }
  const Tensor preactivation = at::linear(x, weight).contiguous();
  return bias_gelu(preactivation, bias.has_value() ? OptionalTensor(bias->contiguous()) : c10::nullopt, approximate);
}

Tensor mlp(const Tensor& x, const Tensor& fc1_weight, const OptionalTensor& fc1_bias, const Tensor& fc2_weight,
           const OptionalTensor& fc2_bias, c10::string_view approximate, const OptionalTensor& residual) {
  const Tensor hidden = linear_gelu(x, fc1_weight, fc1_bias, approximate);
  if (residual.has_value() && residual->scalar_type() == hidden.scalar_type()) {
    return linear_residual(hidden, fc2_weight, fc2_bias, *residual);
  }
  const Tensor out = at::linear(hidden, fc2_weight, fc2_bias);
  return residual.has_value() ? out + *residual : out;
}

}  // namespace

TORCH_LIBRARY_IMPL(vit_kernels, CompositeImplicitAutograd, m) {
  m.impl("linear_residual", &linear_residual);
  m.impl("linear_gelu", &linear_gelu);
  m.impl("mlp", &mlp);
}

}  // namespace vit_kernels::compositions
