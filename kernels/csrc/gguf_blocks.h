// GGUF blocks as the kernels read them (``kernels/gguf.py`` lays them out): their types and
// layouts, one ISA's vectors (AVX-512, else AVX2 with FMA, else plain C++, chosen at build time)
// and the dequantization of a block into them, shared by the fp32 kernels (gguf_ops.cpp) and the
// bf16 ones (gguf_bf16.cpp). Their products by panels, with AVX-512, are gguf_panels.h's.

#pragma once

#include <torch/types.h>  // a third of torch/extension.h's compile time; only the binding files include that
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace duet_gguf {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ2_K = 10;  // GGML's type ids; Q2_K as kernels/gguf.py rewrites it: codes 0-3 a byte, d and m per 16
constexpr int64_t kQ4_1 = 3;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kQ5_K = 13;  // as kernels/gguf.py rewrites it: 32-weight blocks of codes 0-31, d and m
constexpr int64_t kQ6_K = 14;  // as kernels/gguf.py rewrites it: 32-weight blocks of codes less 32
// Not a GGML type: float8 (e4m3fn) weights, 32 codes a block and the block's scale s, s * w
// (compressed-tensors' FP8, kernels/gguf.py's float8_blocks). A code is read as the fp16 whose
// bits are its sign at 15 and its other 7 bits at 7-13: that fp16 is 2^-8 times the code's
// value, normal or subnormal (the fp16 exponent's bias is 15, e4m3's 7), and vcvtph2ps widens
// it exactly, so the weight is that float times 2^8 s (exact) rounded once, as
// compressed-tensors' w.float() * s is.
constexpr int64_t kF8 = 1000;
// Not a GGML type: 8-bit codes u (0-255) with a zero point z and a scale s a block, (u - z) * s
// (compressed-tensors' 8-bit schemes with zero points: u - z spans 9 bits, which no int8 block
// holds). u - z is exact in fp32, so the weight rounds once, as compressed-tensors' (q - z) * s.
constexpr int64_t kQ8Z = 1001;
// Not a GGML type: a checkpoint's bf16 weights, 32 a block (64 bytes), no scale, for a model that
// computes in fp32 (kernels/gguf.py's bf16_blocks): a bf16 is the upper half of the fp32 of the
// same value, so the products are those of the weights widened once, at half the bytes read.
// Each 16 weights are paired for that: 32-bit word j holds weight j in its low half and weight
// 8 + j in its high one, so that a vector of words gives weights 0-7 by a shift and 8-15 by a
// mask, with no shuffle (bf16_half below).
constexpr int64_t kBF16 = 1002;
// Where weight j of a BF16 block sits among its 32 halves (the pairing above).
constexpr int64_t bf16_half(int64_t j) { return (j / 16) * 16 + (j % 16 < 8 ? 2 * (j % 16) : 2 * (j % 16 - 8) + 1); }

// Per block: code bytes, and fp32 scales (Q4_1: 16 bytes of nibbles, d and m; Q8_0: 32 int8, d;
// Q5_K: 32 uint8, d and m; Q6_K: 32 int8, the scales of weights 0-15 and 16-31; F8: 32 e4m3, s;
// Q2_K: 32 uint8, d and m of weights 0-15, then of 16-31; Q8Z: 32 uint8, s and z; BF16: 32 bf16
// paired as above, no scale).
constexpr int64_t code_bytes(int64_t qtype) { return qtype == kQ4_1 ? 16 : qtype == kBF16 ? 64 : 32; }
constexpr int64_t num_scales(int64_t qtype) {
  return qtype == kBF16 ? 0 : qtype == kQ8_0 || qtype == kF8 ? 1 : qtype == kQ2_K ? 4 : 2;
}
constexpr float kF8Unit = 256.0f;  // an F8 code's value over its fp16 reading (above)

// A float8 (e4m3fn) code's value, exactly, for the plain C++ kernels and the tests' references:
// (1 + m / 8) 2^(e - 7), or m / 8 2^-6 where e is 0. NaN codes (0x7F, 0xFF) never reach here
// (the loader refuses them).
inline float f8_value(uint8_t code) {
  const int e = (code >> 3) & 0x0F, m = code & 0x07;
  const float magnitude = e ? std::ldexp(1.0f + m / 8.0f, e - 7) : std::ldexp(m / 8.0f, -6);
  return code & 0x80 ? -magnitude : magnitude;
}

#if defined(__AVX2__) && defined(__F16C__)
// Eight float8 codes (the low 8 bytes of ``bytes``) as the fp16 readings above, 16 bits a lane.
inline __m128i f8_halves(__m128i bytes) {
  const __m128i wide = _mm_cvtepu8_epi16(bytes);
  return _mm_or_si128(_mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x7F)), 7),
                      _mm_slli_epi16(_mm_and_si128(wide, _mm_set1_epi16(0x80)), 8));
}
#endif

// One ISA's vectors: a block of 32 weights is kVecs vectors of kLanes floats.
//
// A Q4_1 block's 32 codes are 16 bytes read as four 32-bit words D0..D3 (``kernels/gguf.py``
// lays them out so): the code of weight 4L + k (L, k in 0..3) is bits 4L..4L+3 of Dk, that of
// weight 16 + 4L + k bits 16+4L..16+4L+3. Broadcast to every 128-bit lane, the words then put
// each weight's code in its own 32-bit lane by a shift, with no shuffle across lanes.
#if defined(__AVX512F__)
struct Isa {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr const char* kName = "avx512";
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // Lane i: the sum of a[i]'s 16 lanes, for 16 vectors at once (45 shuffles and adds against 16
  // separate reductions' 128): pairs within 128-bit lanes, then quads, then across them.
  static V sums(const V* a) {
    V pairs[8], quads[4];
    for (int k = 0; k < 8; ++k)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of x = a[2k], y = a[2k+1]
      pairs[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; ++k) {  // per 128-bit lane: that lane's sums of a[4k..4k+3]
      const __m512d lo = _mm512_castps_pd(pairs[2 * k]), hi = _mm512_castps_pd(pairs[2 * k + 1]);
      quads[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    const V half01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const V half23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(half01, half23, 0x88), _mm512_shuffle_f32x4(half01, half23, 0xDD));
  }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float max_of(V v) { return _mm512_reduce_max_ps(v); }
  static bool any_nan(V v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
  static void q4_1(const uint8_t* codes, const float* scales, V* w) {
    const __m512i words = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m512i low = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12);
    // The 16 values a code stands for, d * i + m, fill one vector; vpermps looks each weight up
    // by the low 4 bits of its lane (what lies above them needs no mask).
    const V table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                    _mm512_set1_ps(scales[0]), _mm512_set1_ps(scales[1]));
    w[0] = _mm512_permutexvar_ps(_mm512_srlv_epi32(words, low), table);
    w[1] = _mm512_permutexvar_ps(_mm512_srlv_epi32(words, _mm512_add_epi32(low, _mm512_set1_epi32(16))), table);
  }
  static void q8_0(const uint8_t* codes, const float* scales, V* w) {
    const V d = _mm512_set1_ps(scales[0]);
    for (int i = 0; i < 2; ++i) {
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i));
      w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qs)), d);
    }
  }
  static void q5_k(const uint8_t* codes, const float* scales, V* w) {
    const V d = _mm512_set1_ps(scales[0]), m = _mm512_set1_ps(scales[1]);
    for (int i = 0; i < 2; ++i) {
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i));
      w[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qs)), d, m);
    }
  }
  static void q6_k(const uint8_t* codes, const float* scales, V* w) {
    for (int i = 0; i < 2; ++i) {
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i));
      w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qs)), _mm512_set1_ps(scales[i]));
    }
  }
  static void q8z(const uint8_t* codes, const float* scales, V* w) {
    const V s = _mm512_set1_ps(scales[0]), z = _mm512_set1_ps(scales[1]);
    for (int i = 0; i < 2; ++i) {
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i));
      w[i] = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qs)), z), s);
    }
  }
  static void q2_k(const uint8_t* codes, const float* scales, V* w) {
    for (int i = 0; i < 2; ++i) {
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i));
      w[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(qs)), _mm512_set1_ps(scales[2 * i]), _mm512_set1_ps(scales[2 * i + 1]));
    }
  }
  // 16 float8 codes as their fp16 readings (f8_halves), widened to fp32: 2^-8 times their values.
  static V f8_readings(const uint8_t* codes) {
    const __m256i wide = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m256i halves = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7F)), 7),
                                           _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8));
    return _mm512_cvtph_ps(halves);
  }
  static void f8(const uint8_t* codes, const float* scales, V* w) {
    const V s = _mm512_set1_ps(scales[0] * kF8Unit);
    for (int i = 0; i < 2; ++i) w[i] = _mm512_mul_ps(f8_readings(codes + 16 * i), s);
  }
  static void bf16(const uint8_t* codes, const float*, V* w) {  // weights 0-7 by a shift, 8-15 by a mask, a 16 at a time
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int i = 0; i < 2; ++i) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * i));
      const __m256d low = _mm256_castsi256_pd(_mm256_slli_epi32(words, 16)), upper = _mm256_castsi256_pd(_mm256_and_si256(words, high));
      w[i] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(low), upper, 1));  // AVX512F's insert (insertf32x8 is DQ's)
    }
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Isa {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr const char* kName = "avx2";
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  // Lane i: the sum of a[i]'s 8 lanes, for 8 vectors at once: pairs within 128-bit lanes, then
  // quads, then the two halves.
  static V sums(const V* a) {
    V pairs[4], quads[2];
    for (int k = 0; k < 4; ++k)
      pairs[k] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm256_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 2; ++k) {
      const __m256d lo = _mm256_castps_pd(pairs[2 * k]), hi = _mm256_castps_pd(pairs[2 * k + 1]);
      quads[k] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(lo, hi)), _mm256_castpd_ps(_mm256_unpackhi_pd(lo, hi)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20), _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
  }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float max_of(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static bool any_nan(V v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
  static V widen(__m128i bytes, bool is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
  }
  static void q4_1(const uint8_t* codes, const float* scales, V* w) {
    const __m256i words = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    const V d = _mm256_set1_ps(scales[0]), m = _mm256_set1_ps(scales[1]);
    for (int i = 0; i < 4; ++i) {  // weights 8i..8i+7: L = 2 * (i % 2) + half, and 16 more for i >= 2
      const int base = 16 * (i / 2) + 8 * (i % 2);
      const __m256i shift = _mm256_setr_epi32(base, base, base, base, base + 4, base + 4, base + 4, base + 4);
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(words, shift), mask)), d, m);
    }
  }
  static void q8_0(const uint8_t* codes, const float* scales, V* w) {
    const V d = _mm256_set1_ps(scales[0]);
    for (int i = 0; i < 4; ++i) {
      const __m128i qs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i));
      w[i] = _mm256_mul_ps(widen(qs, true), d);
    }
  }
  static void q5_k(const uint8_t* codes, const float* scales, V* w) {
    const V d = _mm256_set1_ps(scales[0]), m = _mm256_set1_ps(scales[1]);
    for (int i = 0; i < 4; ++i) {
      const __m128i qs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i));
      w[i] = _mm256_fmadd_ps(widen(qs, false), d, m);
    }
  }
  static void q6_k(const uint8_t* codes, const float* scales, V* w) {
    for (int i = 0; i < 4; ++i) {
      const __m128i qs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i));
      w[i] = _mm256_mul_ps(widen(qs, true), _mm256_set1_ps(scales[i / 2]));
    }
  }
  static void q8z(const uint8_t* codes, const float* scales, V* w) {
    const V s = _mm256_set1_ps(scales[0]), z = _mm256_set1_ps(scales[1]);
    for (int i = 0; i < 4; ++i) {
      const __m128i qs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_sub_ps(widen(qs, false), z), s);
    }
  }
  static void q2_k(const uint8_t* codes, const float* scales, V* w) {
    for (int i = 0; i < 4; ++i) {
      const __m128i qs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i));
      w[i] = _mm256_fmadd_ps(widen(qs, false), _mm256_set1_ps(scales[2 * (i / 2)]), _mm256_set1_ps(scales[2 * (i / 2) + 1]));
    }
  }
  static void f8(const uint8_t* codes, const float* scales, V* w) {
#if defined(__F16C__)
    const V s = _mm256_set1_ps(scales[0] * kF8Unit);
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_mul_ps(_mm256_cvtph_ps(f8_halves(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i)))), s);
#else
    alignas(32) float values[32];
    for (int j = 0; j < 32; ++j) values[j] = f8_value(codes[j]) * scales[0];
    for (int i = 0; i < 4; ++i) w[i] = _mm256_load_ps(values + 8 * i);
#endif
  }
  static void bf16(const uint8_t* codes, const float*, V* w) {  // weights 0-7 by a shift, 8-15 by a mask, a 16 at a time
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int i = 0; i < 2; ++i) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * i));
      w[2 * i] = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
      w[2 * i + 1] = _mm256_castsi256_ps(_mm256_and_si256(words, high));
    }
  }
};
#else
struct Isa {
  using V = float;
  static constexpr int kLanes = 1;
  static constexpr const char* kName = "scalar";
  static V zero() { return 0.0f; }
  static V set1(float f) { return f; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V fmadd(V a, V b, V c) { return a * b + c; }
  static V sums(const V* a) { return a[0]; }  // one lane: a vector is its own sum
  static V max(V a, V b) { return a > b ? a : b; }
  static float max_of(V v) { return v; }
  static bool any_nan(V v) { return v != v; }
  static void q4_1(const uint8_t* codes, const float* scales, V* w) {
    uint32_t words[4];
    std::memcpy(words, codes, 16);
    for (int j = 0; j < 32; ++j) {
      const int shift = 16 * (j / 16) + 4 * ((j % 16) / 4);
      w[j] = scales[0] * static_cast<float>((words[j % 4] >> shift) & 0x0F) + scales[1];
    }
  }
  static void q8_0(const uint8_t* codes, const float* scales, V* w) {
    for (int j = 0; j < 32; ++j) w[j] = scales[0] * static_cast<float>(static_cast<int8_t>(codes[j]));
  }
  static void q5_k(const uint8_t* codes, const float* scales, V* w) {
    for (int j = 0; j < 32; ++j) w[j] = scales[0] * static_cast<float>(codes[j]) + scales[1];
  }
  static void q6_k(const uint8_t* codes, const float* scales, V* w) {
    for (int j = 0; j < 32; ++j) w[j] = scales[j / 16] * static_cast<float>(static_cast<int8_t>(codes[j]));
  }
  static void f8(const uint8_t* codes, const float* scales, V* w) {
    for (int j = 0; j < 32; ++j) w[j] = f8_value(codes[j]) * scales[0];
  }
  static void q8z(const uint8_t* codes, const float* scales, V* w) {
    for (int j = 0; j < 32; ++j) w[j] = (static_cast<float>(codes[j]) - scales[1]) * scales[0];
  }
  static void q2_k(const uint8_t* codes, const float* scales, V* w) {
    for (int j = 0; j < 32; ++j) w[j] = std::fma(scales[2 * (j / 16)], static_cast<float>(codes[j]), scales[2 * (j / 16) + 1]);
  }
  static void bf16(const uint8_t* codes, const float*, V* w) {
    for (int j = 0; j < 32; ++j) {
      uint16_t half;
      std::memcpy(&half, codes + 2 * bf16_half(j), 2);
      const uint32_t bits = static_cast<uint32_t>(half) << 16;
      std::memcpy(&w[j], &bits, 4);
    }
  }
};
#endif

constexpr int kVecs = kBlock / Isa::kLanes;

// store(i, sum of v[i]'s lanes) for i < Count, Isa::kLanes sums at a time (Isa::sums; missing
// vectors are zeros). Each sum adds its own lanes in one fixed order, wherever it sits.
template <int Count, typename Store>
inline void lane_sums(const Isa::V* v, Store store) {
  for (int base = 0; base < Count; base += Isa::kLanes) {
    Isa::V group[Isa::kLanes];
    for (int i = 0; i < Isa::kLanes; ++i) group[i] = base + i < Count ? v[base + i] : Isa::zero();
    alignas(64) float sums[Isa::kLanes];
    Isa::store(sums, Isa::sums(group));
    for (int i = 0; i < Isa::kLanes && base + i < Count; ++i) store(base + i, sums[i]);
  }
}

// Products of a few rows go by tiles of up to 8 rows, each tile's output features split across
// threads C at a time, the last few one at a time: tile(R, C, first_row, n) with R and C as
// std::integral_constant, for the tile of rows from first_row and the features from n. C is what
// the registers hold: R * C * kVecs accumulators. With AVX-512 (32 registers, kVecs 2) 4, 2 or 1
// as the tile has 1, up to 4, or more rows. With AVX2 (16 registers, kVecs 4) 4 for one row and
// 1 for more: on a Zen 3 EPYC, 24 Q4_1/Q8_0 weights of 1,536 x 576 took 1.9 ms at 2 rows, 2.3-2.6
// at 3 and 3.0-3.3 at 4 against 2.1-2.2, 3.0-3.2 and 3.9-4.6 with 2 features a tile. Each
// output's sum runs in the same order whatever R and C: the products are the same bits.
constexpr int tile_columns(int rows) {
  if (rows == 1) return 4;
  return kVecs <= 2 && rows <= 4 ? 2 : 1;
}

template <typename Tile>
inline void by_row_tiles(int64_t M, int64_t N, Tile&& tile) {
  for (int64_t first_row = 0; first_row < M;) {
    const int64_t num_rows = std::min<int64_t>(M - first_row, 8);
    auto run = [&](auto rows) {
      constexpr int R = decltype(rows)::value;
      constexpr int C = tile_columns(R);
      at::parallel_for(0, (N + C - 1) / C, 64 / C, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const int64_t n = i * C;
          if (n + C <= N) {
            tile(rows, std::integral_constant<int, C>{}, first_row, n);
          } else {
            for (int64_t m = n; m < N; ++m) tile(rows, std::integral_constant<int, 1>{}, first_row, m);
          }
        }
      });
    };
    switch (num_rows) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      case 4: run(std::integral_constant<int, 4>{}); break;
      case 5: run(std::integral_constant<int, 5>{}); break;
      case 6: run(std::integral_constant<int, 6>{}); break;
      case 7: run(std::integral_constant<int, 7>{}); break;
      default: run(std::integral_constant<int, 8>{}); break;
    }
    first_row += num_rows;
  }
}

constexpr int64_t kAheadRows = 16;  // rows a tile prefetches ahead (measured: 8 to 32 do as well)

// The N x K weights: codes [N, K / 32 * code_bytes] and scales [N, K / 32 * num_scales].
struct Weights {
  const uint8_t* codes;
  const float* scales;
  int64_t num_blocks;  // a row's
  // The same weights in the panel layout (gguf_ops.cpp's gguf_panel_layout), or none.
  const uint8_t* panel_codes = nullptr;
  const float* panel_scales = nullptr;
};

// A product of few rows waits on memory: a weight row is short (a few hundred bytes), and the
// hardware's stream prefetchers barely start on one before it ends (2.5x slower measured on cold
// weights). So a tile of C rows from row n asks, at each block b, for the rows kAheadRows ahead
// of its own (``ahead``, from ``rows_ahead``), a cache line at a time.
template <int C>
__attribute__((always_inline)) inline void rows_ahead(int64_t n, int64_t N, int64_t (&ahead)[C]) {
  for (int c = 0; c < C; ++c) ahead[c] = std::min<int64_t>(n + c + kAheadRows, N - 1);
}

template <int64_t QType, int C>
__attribute__((always_inline)) inline void prefetch_ahead(const Weights& w, const int64_t (&ahead)[C], int64_t b) {
  const int64_t code_row = w.num_blocks * code_bytes(QType), scale_row = w.num_blocks * num_scales(QType);
  if ((b * code_bytes(QType)) % 64 == 0)
    for (int c = 0; c < C; ++c) __builtin_prefetch(w.codes + ahead[c] * code_row + b * code_bytes(QType));
  if (num_scales(QType) > 0 && (b * num_scales(QType) * 4) % 64 == 0)
    for (int c = 0; c < C; ++c) __builtin_prefetch(w.scales + ahead[c] * scale_row + b * num_scales(QType));
}

template <int64_t QType>
inline void dequant(const Weights& w, int64_t n, int64_t b, Isa::V* out) {
  const uint8_t* codes = w.codes + (n * w.num_blocks + b) * code_bytes(QType);
  const float* scales = w.scales + (n * w.num_blocks + b) * num_scales(QType);
  if constexpr (QType == kQ4_1) Isa::q4_1(codes, scales, out);
  else if constexpr (QType == kQ5_K) Isa::q5_k(codes, scales, out);
  else if constexpr (QType == kQ6_K) Isa::q6_k(codes, scales, out);
  else if constexpr (QType == kF8) Isa::f8(codes, scales, out);
  else if constexpr (QType == kQ2_K) Isa::q2_k(codes, scales, out);
  else if constexpr (QType == kQ8Z) Isa::q8z(codes, scales, out);
  else if constexpr (QType == kBF16) Isa::bf16(codes, scales, out);
  else Isa::q8_0(codes, scales, out);
}

// f(std::integral_constant<int64_t, qtype>) for a qtype the kernels read (checked() has checked it).
template <typename F>
inline void with_qtype(int64_t qtype, F&& f) {
  switch (qtype) {
    case kQ4_1: f(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ5_K: f(std::integral_constant<int64_t, kQ5_K>{}); break;
    case kQ6_K: f(std::integral_constant<int64_t, kQ6_K>{}); break;
    case kF8: f(std::integral_constant<int64_t, kF8>{}); break;
    case kQ2_K: f(std::integral_constant<int64_t, kQ2_K>{}); break;
    case kQ8Z: f(std::integral_constant<int64_t, kQ8Z>{}); break;
    case kBF16: f(std::integral_constant<int64_t, kBF16>{}); break;
    default: f(std::integral_constant<int64_t, kQ8_0>{}); break;
  }
}

// The panel layout (gguf_ops.cpp's gguf_panel_layout) holds panels of 32 output features: per
// block, the 32 features' codes of each k side by side (Q4_1: 16 bytes a k, byte j holding
// feature j's code in its low nibble and feature 16 + j's in its high one; Q8_0, Q5_K and Q6_K:
// 32 bytes a k), then their scales side by side ([num_scales][32]). AVX-512's panels read it.
constexpr int64_t kPanelWidth = 32;
// How a bf16 product goes (gguf_bf16.cpp): by tiles of rows, by panels (vdpbf16ps), by panels on AMX tiles.
constexpr int kBf16Tiles = 0, kBf16Panels = 1, kBf16Amx = 2;
constexpr int64_t panel_code_bytes(int64_t qtype) { return qtype == kQ4_1 ? 16 : qtype == kBF16 ? 64 : 32; }

inline Weights checked(const torch::Tensor& codes, const torch::Tensor& scales, int64_t qtype, int64_t in_features) {
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0 || qtype == kQ5_K || qtype == kQ6_K || qtype == kF8 || qtype == kQ2_K || qtype == kQ8Z ||
                  qtype == kBF16,
              "GGUF type ", qtype, " is not supported (Q2_K = 10, Q4_1 = 3, Q8_0 = 8, Q5_K = 13, Q6_K = 14, F8 = 1000, Q8Z = 1001, BF16 = 1002)");
  TORCH_CHECK(in_features % kBlock == 0, "in_features must be a multiple of ", kBlock);
  const int64_t num_blocks = in_features / kBlock;
  TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous() &&
                  codes.size(1) == num_blocks * code_bytes(qtype),
              "GGUF codes must be contiguous uint8 [out_features, ", num_blocks * code_bytes(qtype), "]: they do not hold ",
              in_features, " weights of type ", qtype, " a row");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat32 && scales.dim() == 2 && scales.is_contiguous() &&
                  scales.size(0) == codes.size(0) && scales.size(1) == num_blocks * num_scales(qtype),
              "GGUF scales must be contiguous fp32 [out_features, ", num_blocks * num_scales(qtype), "]");
  return {codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), num_blocks};
}

// The weights, with their panel layout where one is given (checked against them).
inline Weights with_layout(Weights w, int64_t qtype, int64_t N, const std::optional<torch::Tensor>& panel_codes,
                           const std::optional<torch::Tensor>& panel_scales) {
  TORCH_CHECK(panel_codes.has_value() == panel_scales.has_value(), "the panel layout is its codes and its scales");
  if (!panel_codes) return w;
  TORCH_CHECK(panel_codes->scalar_type() == torch::kUInt8 && panel_codes->is_contiguous() &&
                  panel_codes->numel() == N * w.num_blocks * panel_code_bytes(qtype) && N % kPanelWidth == 0,
              "the panel codes do not lay out these weights (gguf_panel_layout)");
  TORCH_CHECK(panel_scales->scalar_type() == torch::kFloat32 && panel_scales->is_contiguous() &&
                  panel_scales->numel() == N * w.num_blocks * num_scales(qtype),
              "the panel scales do not lay out these weights (gguf_panel_layout)");
  w.panel_codes = panel_codes->data_ptr<uint8_t>();
  w.panel_scales = panel_scales->data_ptr<float>();
  return w;
}

}  // namespace duet_gguf
