// The schemas of every vit_kernels._C operator, defined once. CPU kernels live beside them, each in
// the file of the public op it serves (layer_norm.cpp, linear_gelu.cpp, attention.cpp,
// patch_embed.cpp), CUDA kernels in cuda/<same op>.cu.
//
// All ops take contiguous tensors (the Python wrappers make them so) and treat a (..., C) tensor as
// rows x C. Statistics and reduced gradients are float32 (float64 for float64 inputs).

#include <Python.h>
#include <torch/library.h>

extern PyMethodDef vit_kernels_methods[];  // fast_path_key.cpp

extern "C" {
// Importing vit_kernels._C loads this library, which runs the registrations below; its one Python
// function is the dispatch's per-call key (fast_path_key.cpp).
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, vit_kernels_methods};
  return PyModule_Create(&module_def);
}
}

TORCH_LIBRARY(vit_kernels, m) {
  // y = LN(s) * weight + bias with s = x + residual; returns (y, s or an empty tensor, mean, rstd).
  m.def("fused_layer_norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps)"
        " -> (Tensor, Tensor, Tensor, Tensor)");
  // Returns (d s, d weight, d bias); d s already includes grad_summed (the gradient reaching s directly).
  m.def("fused_layer_norm_backward(Tensor grad_out, Tensor? grad_summed, Tensor summed, Tensor? weight,"
        " Tensor mean, Tensor rstd, bool weight_bias_grad) -> (Tensor, Tensor, Tensor)");
  // y = gelu(x + bias), approximate 'none' (erf), 'tanh' or 'quick' (z * sigmoid(1.702 z)).
  m.def("bias_gelu(Tensor x, Tensor? bias, str approximate) -> Tensor");
  // Returns (d z, d bias) for z = x + bias: d z = grad_out * gelu'(z) and, when bias_grad, d bias =
  // sum_rows d z in float32 (C,) (else an empty tensor), reduced in the pass that writes d z.
  m.def("bias_gelu_backward(Tensor grad_out, Tensor x, Tensor? bias, str approximate, bool bias_grad)"
        " -> (Tensor, Tensor)");
  // Softmax over the last dimension, and dx = y * (dy - sum(dy * y)).
  m.def("softmax(Tensor x) -> Tensor");
  m.def("softmax_backward(Tensor grad_out, Tensor out) -> Tensor");
  // (N, C, H, W) (NCHW or channels_last) -> (N, (H/P) * (W/P), C * P * P), columns ordered (c, i, j)
  // like a Conv2d weight flattened; and its adjoint, back to (N, C, H, W) NCHW with zeros where no
  // patch reaches (H or W not a multiple of P).
  m.def("patchify(Tensor images, int patch_size) -> Tensor");
  m.def("unpatchify(Tensor patches, int channels, int height, int width, int patch_size) -> Tensor");

  // The extension backend's compositions (compositions.cpp): a GEMM with the kernels around it.
  // x (..., K) @ weight (N, K)^T accumulated onto residual (..., N) (+ bias (N,)).
  m.def("linear_residual(Tensor x, Tensor weight, Tensor? bias, Tensor residual) -> Tensor");
  // gelu(x @ weight^T + bias): a GEMM, then bias_gelu.
  m.def("linear_gelu(Tensor x, Tensor weight, Tensor? bias, str approximate) -> Tensor");
  // linear_gelu, then fc2 (accumulating onto the residual when it has the hidden dtype).
  m.def("mlp(Tensor x, Tensor fc1_weight, Tensor? fc1_bias, Tensor fc2_weight, Tensor? fc2_bias, str approximate,"
        " Tensor? residual) -> Tensor");
  // qkv (B, L, 3*H*Dh) -> (out (B, L, H*Dh), probs (B, H, L, L), the softmax before dropout).
  m.def("attention_explicit(Tensor qkv, int num_heads, float scale, float dropout_p) -> (Tensor, Tensor)");
}
