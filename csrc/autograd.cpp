// The autograd of the kernel ops (TORCH_LIBRARY_IMPL(vit_kernels, Autograd, m)), in C++ so that an
// eager call costs one dispatcher call plus one autograd node: no Python autograd.Function, no
// Python autograd kernel behind the dispatcher (together ~10 us per call on the host). Each forward
// runs the op below the autograd key (its CPU or CUDA kernel); each backward calls the matching
// backward op. torch.compile traces through these the same way (the fake implementations are
// registered in Python, in vit_kernels/ops/<op>.py).
//
//   fused_layer_norm:  (y, s, mean, rstd) = LN(x + residual) (gradients reaching mean and rstd are
//                      ignored: they are statistics);  d x = d residual = d s_total, where
//                      d s_total = LN'(d y) + d s (the gradient reaching the returned sum directly);
//                      d weight = sum_rows d y * xhat, d bias = sum_rows d y (float32, then the
//                      parameter's dtype)
//   bias_gelu:         y = gelu(x + bias);  d x = d y * gelu'(x + bias),  d bias = sum_rows d x (float32,
//                      reduced by the backward kernel in the pass that writes d x, then the bias's dtype)
//   softmax:           y = softmax(x);      d x = y * (d y - sum(d y * y))
//   patchify:          its adjoint unpatchify is its derivative, and the reverse: both differentiable
//                      again (a gradient penalty through patch_embed works)
//   attention_explicit: the extension's attention, (out, P) = (P V merged to (B, L, H*Dh), P) with
//                      P = softmax(S), S = scale Q K^T (by the softmax kernel, float32 for 16-bit
//                      inputs): one node whose backward is
//                      dV = P^T dO,  dP = dO V^T (+ the gradient reaching P),  dS = scale softmax'(dP),
//                      dQ = dS K,  dK = dS^T Q,  packed back into d qkv (B, L, 3D) in one copy.
//                      With dropout it is a composition of differentiable ops instead.
//
// The kernels' backwards are not differentiable themselves: a second derivative through them raises
// (as Python's @once_differentiable does) instead of treating the first derivative as a constant.

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>

namespace vit_kernels::autograd {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using OptionalTensor = c10::optional<at::Tensor>;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using LayerNormFwd = std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const OptionalTensor&,
                                                                 const OptionalTensor&, const OptionalTensor&, double);
using LayerNormBwd = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const OptionalTensor&, const Tensor&,
                                                        const OptionalTensor&, const Tensor&, const Tensor&, bool);
using BiasGeluFwd = Tensor(const Tensor&, const OptionalTensor&, c10::string_view);
using BiasGeluBwd = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptionalTensor&, c10::string_view,
                                                bool);
using SoftmaxFwd = Tensor(const Tensor&);
using SoftmaxBwd = Tensor(const Tensor&, const Tensor&);
using Patchify = Tensor(const Tensor&, int64_t);
using Unpatchify = Tensor(const Tensor&, int64_t, int64_t, int64_t, int64_t);

OptionalTensor optional(const Tensor& t) { return t.defined() ? OptionalTensor(t) : c10::nullopt; }

// Whether argument `index` of a forward needs its gradient. `present` has bit i set where argument i
// is a defined tensor: autograd gives an edge only to those, and needs_input_grad counts edges.
bool needs_grad(AutogradContext* ctx, int64_t present, int index) {
  if (((present >> index) & 1) == 0) return false;
  const int edge = __builtin_popcountll(static_cast<uint64_t>(present) & ((uint64_t{1} << index) - 1));
  return ctx->needs_input_grad(edge);
}

bool any_requires_grad(const variable_list& tensors) {
  return std::any_of(tensors.begin(), tensors.end(), [](const Tensor& t) { return t.defined() && t.requires_grad(); });
}

// The gradients of a backward computed under no_grad, returned so that differentiating them again
// raises: with grad mode on (create_graph) and a gradient requiring grad, each defined result is
// aliased through a node that fails when reached, as Python's @once_differentiable does.
variable_list once_differentiable(const char* op, const variable_list& grad_outputs, variable_list grads) {
  if (!at::GradMode::is_enabled() || !any_requires_grad(grad_outputs)) return grads;
  variable_list aliases;
  aliases.reserve(grads.size());
  for (const Tensor& grad : grads) aliases.push_back(grad.defined() ? grad.detach().requires_grad_(true) : Tensor());
  torch::autograd::DelayedError node(std::string("trying to differentiate twice ") + op +
                                         ", whose backward is a kernel that is not itself differentiable",
                                     static_cast<int64_t>(aliases.size()));
  return node.apply(std::move(aliases));
}

// ---- fused_layer_norm ------------------------------------------------------------------------------

class FusedLayerNormFunction : public torch::autograd::Function<FusedLayerNormFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptionalTensor& residual,
                               const OptionalTensor& weight, const OptionalTensor& bias, double eps) {
    static const auto op = find_op<LayerNormFwd>("vit_kernels::fused_layer_norm");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, summed, mean, rstd] = op.call(x, residual, weight, bias, eps);
    ctx->save_for_backward({residual.has_value() ? summed : x, weight.value_or(Tensor()), mean, rstd});
    ctx->saved_data["present"] = int64_t{1} | int64_t{residual.has_value()} << 1 | int64_t{weight.has_value()} << 2 |
                                 int64_t{bias.has_value()} << 3;
    return {y, summed, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = find_op<LayerNormBwd>("vit_kernels::fused_layer_norm_backward");
    const auto saved = ctx->get_saved_variables();
    const Tensor &summed = saved[0], &weight = saved[1], &mean = saved[2], &rstd = saved[3];
    const int64_t present = ctx->saved_data["present"].toInt();
    const bool has_residual = (present >> 1) & 1;
    const bool needs_weight = needs_grad(ctx, present, 2), needs_bias = needs_grad(ctx, present, 3);
    variable_list result(5);
    {
      at::NoGradGuard no_grad;
      const OptionalTensor grad_summed = has_residual ? OptionalTensor(grads[1].contiguous()) : c10::nullopt;
      auto [ds, dw, db] =
          op.call(grads[0].contiguous(), grad_summed, summed, optional(weight), mean, rstd, needs_weight || needs_bias);
      if (needs_grad(ctx, present, 0)) result[0] = ds;
      if (needs_grad(ctx, present, 1)) result[1] = ds;
      if (needs_weight) result[2] = dw.to(weight.scalar_type());
      if (needs_bias) result[3] = db.to(summed.scalar_type());
    }
    return once_differentiable("vit_kernels::fused_layer_norm", grads, std::move(result));
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor> fused_layer_norm(const Tensor& x, const OptionalTensor& residual,
                                                            const OptionalTensor& weight, const OptionalTensor& bias,
                                                            double eps) {
  auto outputs = FusedLayerNormFunction::apply(x, residual, weight, bias, eps);
  return {outputs[0], outputs[1], outputs[2], outputs[3]};
}

// ---- bias_gelu -------------------------------------------------------------------------------------

class BiasGeluFunction : public torch::autograd::Function<BiasGeluFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const OptionalTensor& bias,
                        c10::string_view approximate) {
    static const auto op = find_op<BiasGeluFwd>("vit_kernels::bias_gelu");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, bias.value_or(Tensor())});
    ctx->saved_data["approximate"] = std::string(approximate);
    ctx->saved_data["present"] = int64_t{1} | int64_t{bias.has_value()} << 1;
    return op.call(x, bias, approximate);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = find_op<BiasGeluBwd>("vit_kernels::bias_gelu_backward");
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &bias = saved[1];
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    variable_list result(3);
    {
      at::NoGradGuard no_grad;
      const int64_t present = ctx->saved_data["present"].toInt();
      const bool needs_bias = needs_grad(ctx, present, 1);
      auto [dz, db] = op.call(grads[0].contiguous(), x, optional(bias), approximate, needs_bias);
      if (needs_bias) result[1] = db.to(bias.scalar_type());
      if (needs_grad(ctx, present, 0)) result[0] = std::move(dz);
    }
    return once_differentiable("vit_kernels::bias_gelu", grads, std::move(result));
  }
};

Tensor bias_gelu(const Tensor& x, const OptionalTensor& bias, c10::string_view approximate) {
  return BiasGeluFunction::apply(x, bias, approximate);
}

// ---- softmax ---------------------------------------------------------------------------------------

class SoftmaxFunction : public torch::autograd::Function<SoftmaxFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x) {
    static const auto op = find_op<SoftmaxFwd>("vit_kernels::softmax");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    Tensor y = op.call(x);
    ctx->save_for_backward({y});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = find_op<SoftmaxBwd>("vit_kernels::softmax_backward");
    variable_list result(1);
    {
      at::NoGradGuard no_grad;
      result[0] = op.call(grads[0].contiguous(), ctx->get_saved_variables()[0]);
    }
    return once_differentiable("vit_kernels::softmax", grads, std::move(result));
  }
};

Tensor softmax(const Tensor& x) { return SoftmaxFunction::apply(x); }

// ---- patchify / unpatchify (each the other's derivative) -------------------------------------------

const auto& patchify_op() {
  static const auto op = find_op<Patchify>("vit_kernels::patchify");
  return op;
}

const auto& unpatchify_op() {
  static const auto op = find_op<Unpatchify>("vit_kernels::unpatchify");
  return op;
}

class PatchifyFunction : public torch::autograd::Function<PatchifyFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& images, int64_t patch_size) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->saved_data["patch_size"] = patch_size;
    ctx->saved_data["image_shape"] = images.sizes().slice(1).vec();  // (C, H, W)
    return patchify_op().call(images, patch_size);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto shape = ctx->saved_data["image_shape"].toIntVector();
    // through the dispatcher with autograd: differentiable again
    return {unpatchify_op().call(grads[0].contiguous(), shape[0], shape[1], shape[2],
                                 ctx->saved_data["patch_size"].toInt()),
            Tensor()};
  }
};

class UnpatchifyFunction : public torch::autograd::Function<UnpatchifyFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& patches, int64_t channels, int64_t height, int64_t width,
                        int64_t patch_size) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->saved_data["patch_size"] = patch_size;
    return unpatchify_op().call(patches, channels, height, width, patch_size);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {patchify_op().call(grads[0].contiguous(), ctx->saved_data["patch_size"].toInt()), Tensor(), Tensor(),
            Tensor(), Tensor()};
  }
};

Tensor patchify(const Tensor& images, int64_t patch_size) { return PatchifyFunction::apply(images, patch_size); }

Tensor unpatchify(const Tensor& patches, int64_t channels, int64_t height, int64_t width, int64_t patch_size) {
  return UnpatchifyFunction::apply(patches, channels, height, width, patch_size);
}

// ---- attention_explicit ----------------------------------------------------------------------------

// Sizes are read as SymInts throughout, so that under torch.compile with dynamic shapes they stay
// symbolic (a plain size read would guard on its value and recompile per batch size).
struct AttentionShape {
  c10::SymInt batch, length, heads, head_dim;
  c10::SymInt batch_heads() const { return batch * heads; }
};

AttentionShape attention_shape(const Tensor& qkv, int64_t num_heads) {
  TORCH_CHECK(num_heads > 0, "vit_kernels::attention_explicit: num_heads must be positive, got ", num_heads);
  TORCH_CHECK(qkv.dim() == 3 && qkv.sym_size(2) % (3 * num_heads) == 0,
              "vit_kernels::attention_explicit: qkv must have shape (B, L, 3 * num_heads * head_dim), got ",
              qkv.sym_sizes(), " with num_heads = ", num_heads);
  return {qkv.sym_size(0), qkv.sym_size(1), c10::SymInt(num_heads), qkv.sym_size(2) / (3 * num_heads)};
}

bool is_narrow(const Tensor& t) { return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16; }

// (B, L, 3*D) -> (3, B*H, L, Dh) in one copy (float32 for 16-bit inputs): q, k, v are its slices.
Tensor split_heads(const Tensor& qkv, const AttentionShape& s) {
  return (is_narrow(qkv) ? qkv.to(at::kFloat) : qkv)
      .view_symint({s.batch, s.length, 3, s.heads, s.head_dim})
      .permute({2, 0, 3, 1, 4})
      .reshape_symint({3, s.batch_heads(), s.length, s.head_dim});
}

// (B*H, L, Dh) -> (B, L, H*Dh)
Tensor merge_heads(const Tensor& t, const AttentionShape& s) {
  return t.view_symint({s.batch, s.heads, s.length, s.head_dim})
      .transpose(1, 2)
      .reshape_symint({s.batch, s.length, s.head_dim * s.heads});
}

// -> (out (B, L, D), P (B, H, L, L) in the compute dtype); with autograd recorded where enabled. P is
// made in its returned shape (not a view of a (B*H, L, L) tensor: a custom Function returning a view
// would have its sizes made concrete under torch.compile).
std::tuple<Tensor, Tensor> attention_forward(const Tensor& qkv, const AttentionShape& s, double scale,
                                             double dropout_p) {
  static const auto softmax_op = find_op<SoftmaxFwd>("vit_kernels::softmax");
  const auto parts = split_heads(qkv, s).unbind(0);
  const Tensor scores = at::bmm(parts[0], parts[1].transpose(1, 2)).mul_(scale);
  const Tensor probs = softmax_op.call(scores.view_symint({s.batch, s.heads, s.length, s.length}));
  const Tensor dropped = dropout_p > 0 ? at::dropout(probs, dropout_p, /*train=*/true) : probs;
  const Tensor out = merge_heads(at::bmm(dropped.view_symint({s.batch_heads(), s.length, s.length}), parts[2]), s);
  return {is_narrow(qkv) ? out.to(qkv.scalar_type()) : out, probs};
}

// The op's outputs: the attention maps in the input's dtype.
std::tuple<Tensor, Tensor> attention_outputs(const Tensor& qkv, const Tensor& out, const Tensor& probs) {
  return {out, is_narrow(qkv) ? probs.to(qkv.scalar_type()) : probs};
}

// Below autograd (no gradient); with autograd recorded, the dropout path of the Autograd kernel.
std::tuple<Tensor, Tensor> attention_explicit_kernel(const Tensor& qkv, int64_t num_heads, double scale,
                                                     double dropout_p) {
  auto [out, probs] = attention_forward(qkv, attention_shape(qkv, num_heads), scale, dropout_p);
  return attention_outputs(qkv, out, probs);
}

class AttentionExplicitFunction : public torch::autograd::Function<AttentionExplicitFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& qkv, int64_t num_heads, double scale) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const AttentionShape s = attention_shape(qkv, num_heads);
    auto [out, probs] = attention_forward(qkv, s, scale, 0.0);
    ctx->save_for_backward({qkv, probs});
    ctx->saved_data["num_heads"] = num_heads;
    ctx->saved_data["scale"] = scale;
    auto [result, maps] = attention_outputs(qkv, out, probs);
    return {result, maps};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto softmax_backward = find_op<SoftmaxBwd>("vit_kernels::softmax_backward");
    const auto saved = ctx->get_saved_variables();
    const Tensor& qkv = saved[0];
    const AttentionShape s = attention_shape(qkv, ctx->saved_data["num_heads"].toInt());
    const Tensor p = saved[1].view_symint({s.batch_heads(), s.length, s.length});  // (B*H, L, L)
    const double scale = ctx->saved_data["scale"].toDouble();
    variable_list result(3);
    const Tensor &grad_out = grads[0], &grad_maps = grads[1];
    if (!grad_out.defined() && !grad_maps.defined()) return result;
    {
      at::NoGradGuard no_grad;
      const Tensor heads = split_heads(qkv, s);  // (3, B*H, L, Dh): q, k, v
      Tensor d_probs, dv;                        // (B*H, L, L), (B*H, L, Dh)
      if (grad_out.defined()) {
        const Tensor d_out = grad_out.to(heads.scalar_type())
                                 .reshape_symint({s.batch, s.length, s.heads, s.head_dim})
                                 .transpose(1, 2)
                                 .reshape_symint({s.batch_heads(), s.length, s.head_dim});
        dv = at::bmm(p.transpose(1, 2), d_out);
        d_probs = at::bmm(d_out, heads[2].transpose(1, 2));
      } else {
        dv = at::zeros_like(heads[2]);
      }
      if (grad_maps.defined()) {
        const Tensor extra = grad_maps.to(p.scalar_type()).reshape_symint({s.batch_heads(), s.length, s.length});
        d_probs = d_probs.defined() ? d_probs.add_(extra) : extra.contiguous();
      }
      const Tensor d_scores = softmax_backward.call(d_probs, p).mul_(scale);
      const Tensor d_heads = at::stack({at::bmm(d_scores, heads[1]), at::bmm(d_scores.transpose(1, 2), heads[0]), dv});
      result[0] = d_heads.view_symint({3, s.batch, s.heads, s.length, s.head_dim})
                      .permute({1, 3, 0, 2, 4})
                      .reshape_symint({s.batch, s.length, 3 * s.heads * s.head_dim})
                      .to(qkv.scalar_type());
    }
    return once_differentiable("vit_kernels::attention_explicit", grads, std::move(result));
  }
};

std::tuple<Tensor, Tensor> attention_explicit(const Tensor& qkv, int64_t num_heads, double scale, double dropout_p) {
  if (dropout_p > 0) {  // a composition of differentiable ops (dropout's mask lives in its own node)
    return attention_explicit_kernel(qkv, num_heads, scale, dropout_p);
  }
  auto outputs = AttentionExplicitFunction::apply(qkv, num_heads, scale);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(vit_kernels, CompositeExplicitAutograd, m) {
  m.impl("attention_explicit", &attention_explicit_kernel);
}

TORCH_LIBRARY_IMPL(vit_kernels, Autograd, m) {
  m.impl("attention_explicit", &attention_explicit);
  m.impl("fused_layer_norm", &fused_layer_norm);
  m.impl("bias_gelu", &bias_gelu);
  m.impl("softmax", &softmax);
  m.impl("patchify", &patchify);
  m.impl("unpatchify", &unpatchify);
}

}  // namespace vit_kernels::autograd
