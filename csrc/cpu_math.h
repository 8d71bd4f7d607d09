// Scalar math for the CPU kernels, written without library calls so that loops over arrays of
// float vectorise (#pragma omp simd), and compiled for AVX-512, AVX2 and a baseline with runtime
// selection (VIT_KERNELS_CPU_CLONES).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <bit>
#include <type_traits>

#include "gelu_forms.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define VIT_KERNELS_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VIT_KERNELS_CPU_CLONES
#endif

// Forced inlining: a call left in a loop stops it from vectorising.
#if defined(__GNUC__)
#define VIT_KERNELS_INLINE inline __attribute__((always_inline))
#else
#define VIT_KERNELS_INLINE inline
#endif

namespace vit_kernels::cpu {

// The accumulation type: double for double, float for float, half and bfloat16.
template <typename scalar_t>
using acc_type = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// exp(x) = 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln2/2, ln2/2]; exp(r) by its
// Taylor series to r^7 (relative error < 1e-8 there); 2^n by building the float's exponent bits.
// Non-finite and out-of-range values behave as std::exp: NaN stays NaN, exp(x) = 0 below -87
// (exp(-87) is 1.6e-38, at the edge of the normal floats) and +inf above 88. The polynomial runs on a
// clamped copy and the special cases are chosen by select, with no branch, so loops still vectorise.
VIT_KERNELS_INLINE float fast_exp(float x) {
  const float value = x;
  const float above = x > -87.0f ? x : -87.0f;  // NaN -> -87 here; restored below
  x = above < 88.0f ? above : 88.0f;
  // Round to nearest by adding and subtracting 1.5 * 2^23 (|x / ln 2| < 2^22): no library call.
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  // ln 2 split in a high part exact in float and a low part, so r keeps its low bits.
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float result = p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
  const float in_range = value < -87.0f ? 0.0f : (value > 88.0f ? std::numeric_limits<float>::infinity() : result);
  return value == value ? in_range : value;
}

// erf(x) = 1 - t (a1 + t (a2 + ...)) exp(-x^2), t = 1 / (1 + p |x|), odd in x; absolute error < 1.5e-7
// (Abramowitz and Stegun 7.1.26).
VIT_KERNELS_INLINE float fast_erf(float x) {
  const float ax = std::fabs(x);
  const float t = 1.0f / (1.0f + 0.3275911f * ax);
  float poly = 1.061405429f;
  poly = poly * t + -1.453152027f;
  poly = poly * t + 1.421413741f;
  poly = poly * t + -0.284496736f;
  poly = poly * t + 0.254829592f;
  const float y = 1.0f - poly * t * fast_exp(-ax * ax);
  return std::copysign(y, x);
}

template <typename acc_t>
VIT_KERNELS_INLINE acc_t exp_of(acc_t x) {
  if constexpr (std::is_same_v<acc_t, float>) return fast_exp(x);
  else return std::exp(x);
}

template <typename acc_t>
VIT_KERNELS_INLINE acc_t erf_of(acc_t x) {
  if constexpr (std::is_same_v<acc_t, float>) return fast_erf(x);
  else return std::erf(x);
}

constexpr double kInvSqrt2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kTanhCubic = 0.044715;

// The GELU of form kForm (checks.h GeluForm) and its derivative:
// erf:   gelu(z) = z Phi(z) = 0.5 z (1 + erf(z / sqrt 2));  gelu'(z) = Phi(z) + z phi(z).
// tanh:  gelu(z) = 0.5 z (1 + tanh u), u = sqrt(2/pi) (z + 0.044715 z^3);
//        gelu'(z) = 0.5 (1 + tanh u) + 0.5 z (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 z^2).
// quick: gelu(z) = z s, s = sigmoid(1.702 z) = 1 / (1 + exp(-1.702 z));  gelu'(z) = s + 1.702 z s (1 - s).
// Where tanh u or s nears -1 or 1, 1 + tanh u, 1 - tanh^2 u and 1 - s are taken without cancellation:
// with e = exp(-2|u|), 1 + tanh u = 2 / (1 + e) (u >= 0) or 2e / (1 + e), 1 - tanh^2 u = 4e / (1 + e)^2,
// and with e = exp(-1.702 |z|), s = 1 / (1 + e) (z >= 0) or e / (1 + e), s (1 - s) = e / (1 + e)^2.
template <typename acc_t>
struct TanhTerms {
  acc_t one_plus_t, sech2;
};

template <typename acc_t>
VIT_KERNELS_INLINE TanhTerms<acc_t> tanh_terms(acc_t u) {
  const acc_t e = exp_of(acc_t(-2) * (u < acc_t(0) ? -u : u));
  const acc_t inv = acc_t(1) / (acc_t(1) + e);
  return {u >= acc_t(0) ? acc_t(2) * inv : acc_t(2) * e * inv, acc_t(4) * e * inv * inv};
}

template <int kForm, typename acc_t>
VIT_KERNELS_INLINE acc_t gelu(acc_t z) {
  if constexpr (kForm == kGeluTanh) {
    const acc_t u = acc_t(kSqrt2OverPi) * (z + acc_t(kTanhCubic) * z * z * z);
    return acc_t(0.5) * z * tanh_terms(u).one_plus_t;
  } else if constexpr (kForm == kGeluQuick) {
    return z / (acc_t(1) + exp_of(acc_t(-kQuickGeluSlope) * z));
  } else {
    return acc_t(0.5) * z * (acc_t(1) + erf_of(z * acc_t(kInvSqrt2)));
  }
}

template <int kForm, typename acc_t>
VIT_KERNELS_INLINE acc_t gelu_grad(acc_t z) {
  if constexpr (kForm == kGeluTanh) {
    const acc_t u = acc_t(kSqrt2OverPi) * (z + acc_t(kTanhCubic) * z * z * z);
    const TanhTerms<acc_t> t = tanh_terms(u);
    const acc_t du = acc_t(kSqrt2OverPi) * (acc_t(1) + acc_t(3 * kTanhCubic) * z * z);
    return acc_t(0.5) * t.one_plus_t + acc_t(0.5) * z * t.sech2 * du;
  } else if constexpr (kForm == kGeluQuick) {
    const acc_t e = exp_of(acc_t(-kQuickGeluSlope) * (z < acc_t(0) ? -z : z));
    const acc_t inv = acc_t(1) / (acc_t(1) + e);
    return (z >= acc_t(0) ? inv : e * inv) + acc_t(kQuickGeluSlope) * z * e * inv * inv;
  } else {
    return acc_t(0.5) * (acc_t(1) + erf_of(z * acc_t(kInvSqrt2))) + z * acc_t(kInvSqrt2Pi) * exp_of(acc_t(-0.5) * z * z);
  }
}

// Row buffers: scalar_t <-> acc_t. For float rows these are plain copies.
template <typename scalar_t, typename acc_t>
inline void load_row(const scalar_t* src, acc_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<acc_t>(src[i]);
}

template <typename scalar_t, typename acc_t>
inline void store_row(const acc_t* src, scalar_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<scalar_t>(src[i]);
}

}  // namespace vit_kernels::cpu
