// bf16 rows 16 lanes at a time with AVX512_BF16, for cpu_ops.cpp's norms and SiLU-and-mul and
// the AMX prompt attention: widened exactly, computed in fp32, rounded as torch rounds them.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// out = silu(x[:, :n]) * x[:, n:], silu computed in fp32 and rounded, as in transformers. Below
// -ln(FLT_MAX) exp(-g) overflows and torch's silu is -0: so it is here (under -ffast-math the
// vectorized division by that infinite sum gave NaN: gates of -89 and -100 did, -1000 not).
constexpr float kSiluZeroBelow = -88.72283935546875f;

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// e^x for x <= 88.72 (kSiluZeroBelow's negation; above, the lanes overflow): x = n ln 2 + r,
// |r| <= ln 2 / 2, e^r by its Taylor terms to r^7 (the series' own error under 10^-8, below
// fp32's rounding), times 2^n. SiLU's and the AMX attention's softmax's.
inline __m512 exp_lanes(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts: n * the first is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 e = _mm512_set1_ps(1.f / 5040);
  for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(e, n);
}

inline __m512 bf16_lanes(const c10::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// Rounded to bf16 to nearest even (vcvtneps2bf16; it flushes fp32 denormals, which torch's
// rounding keeps: values below 1.2e-38 in magnitude).
inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

inline __m512 widen(__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); }

inline void store_bf16(c10::BFloat16* p, __m256i bf16) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16); }

// One bf16 row of rms_norm_kernel, 16 features at a time (hidden a multiple of 16): the same
// roundings (the residual's sum, the normed row, its product with the weight), the squares
// summed in 16 lanes.
inline void bf16_rms_norm_row(c10::BFloat16* x, c10::BFloat16* residual, const c10::BFloat16* weight, int64_t hidden, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 16) {
    __m512 h = bf16_lanes(x + i);
    if (residual != nullptr) {
      const __m256i sum = to_bf16(_mm512_add_ps(bf16_lanes(residual + i), h));
      store_bf16(residual + i, sum);
      h = widen(sum);
    }
    squares = _mm512_fmadd_ps(h, h, squares);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / hidden + eps));
  for (int64_t i = 0; i < hidden; i += 16) {
    const __m512 h = bf16_lanes(residual != nullptr ? residual + i : x + i);
    store_bf16(x + i, to_bf16(_mm512_mul_ps(bf16_lanes(weight + i), widen(to_bf16(_mm512_mul_ps(h, inv))))));
  }
}

// 16 outputs of bf16's SiLU-and-mul: silu(g) = g / (1 + e^-g) in fp32 (an IEEE division),
// rounded to bf16, times up, rounded; -0 below kSiluZeroBelow.
inline __m256i silu_and_mul_16(const c10::BFloat16* gate, const c10::BFloat16* up) {
  const __m512 g = bf16_lanes(gate);
  const __mmask16 zero = _mm512_cmp_ps_mask(g, _mm512_set1_ps(kSiluZeroBelow), _CMP_LT_OQ);
  const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.f), exp_lanes(_mm512_sub_ps(_mm512_setzero_ps(), g)));
  const __m512 silu = _mm512_mask_mov_ps(_mm512_div_ps(g, denominator), zero, _mm512_set1_ps(-0.f));
  return to_bf16(_mm512_mul_ps(widen(to_bf16(silu)), bf16_lanes(up)));
}
#endif

}  // namespace
