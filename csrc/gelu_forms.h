// The GELU forms the bias_gelu kernels take (vit_kernels/activations.py GELU_FORMS, same numbers):
// the exact one with erf, the tanh approximation, and QuickGELU z * sigmoid(1.702 z).
#pragma once

namespace vit_kernels {

enum GeluForm : int { kGeluErf = 0, kGeluTanh = 1, kGeluQuick = 2 };

constexpr double kQuickGeluSlope = 1.702;

}  // namespace vit_kernels
