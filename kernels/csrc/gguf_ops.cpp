// Matmuls over llama.cpp's quantized weights: the GGUF file's 4- and 8-bit codes as they are,
// and their scales beside them (``kernels/gguf.py`` splits each block into its codes and its
// fp16 scale and min, widened to fp32 once, exactly, so that no step converts them again).
//
// Each block of 32 weights is dequantized in registers and multiplied in fp32, so the weights
// a product uses are bit for bit those of gguf's own dequantizer: d * q is exact in fp32 (an
// fp16 scale times a 4- or 8-bit integer), and Q4_1's "+ m" rounds once, as gguf's does (an
// fma rounds d * q + m once too, and d * q has nothing to round). Only the bytes read shrink:
// 0.75 byte a weight for Q4_1 and 1.125 for Q8_0, against 4 for fp32. (K-quants arrive rewritten
// into these blocks: Q4_K as Q4_1, Q6_K as int8 codes with a scale per 16.) A decode step of a few
// rows reads every weight once and computes little with it: its speed is the speed of reading
// the weights, which is what this buys.
//
// Built apart from cpu_ops.cpp, without -ffast-math: nothing may reassociate the dequantization.
// The widest vectors this CPU has are chosen at build time (-march=native on this machine):
// AVX-512, else AVX2 with FMA, else plain C++.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1 = 3;  // GGML's type ids
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kQ6_K = 14;  // as kernels/gguf.py rewrites it: 32-weight blocks of codes less 32

// Per block: code bytes, and fp32 scales (Q4_1: 16 bytes of nibbles, d and m; Q8_0: 32 int8, d;
// Q6_K: 32 int8, the scales of weights 0-15 and 16-31).
constexpr int64_t code_bytes(int64_t qtype) { return qtype == kQ4_1 ? 16 : 32; }
constexpr int64_t num_scales(int64_t qtype) { return qtype == kQ8_0 ? 1 : 2; }

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
  static void q6_k(const uint8_t* codes, const float* scales, V* w) {
    for (int i = 0; i < 2; ++i) {
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * i));
      w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qs)), _mm512_set1_ps(scales[i]));
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
  static void q6_k(const uint8_t* codes, const float* scales, V* w) {
    for (int i = 0; i < 4; ++i) {
      const __m128i qs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i));
      w[i] = _mm256_mul_ps(widen(qs, true), _mm256_set1_ps(scales[i / 2]));
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
  static void q6_k(const uint8_t* codes, const float* scales, V* w) {
    for (int j = 0; j < 32; ++j) w[j] = scales[j / 16] * static_cast<float>(static_cast<int8_t>(codes[j]));
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

constexpr int64_t kAheadRows = 16;  // rows a tile prefetches ahead (measured: 8 to 32 do as well)

// The N x K weights: codes [N, K / 32 * code_bytes] and scales [N, K / 32 * num_scales].
struct Weights {
  const uint8_t* codes;
  const float* scales;
  int64_t num_blocks;  // a row's
};

template <int64_t QType>
inline void dequant(const Weights& w, int64_t n, int64_t b, Isa::V* out) {
  const uint8_t* codes = w.codes + (n * w.num_blocks + b) * code_bytes(QType);
  const float* scales = w.scales + (n * w.num_blocks + b) * num_scales(QType);
  if constexpr (QType == kQ4_1) Isa::q4_1(codes, scales, out);
  else if constexpr (QType == kQ6_K) Isa::q6_k(codes, scales, out);
  else Isa::q8_0(codes, scales, out);
}

// out[r, n] = sum_k x[r, k] * W[n, k] for R rows of x and C output features at a time, every
// block dequantized once for all R rows. R * C * kVecs accumulators stay in registers.
template <int64_t QType, int R, int C>
void tile(const float* x, int64_t K, const Weights& w, int64_t n, float* out, int64_t N) {
  Isa::V acc[R][C][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) acc[r][c][v] = Isa::zero();
  const int64_t code_row = w.num_blocks * code_bytes(QType), scale_row = w.num_blocks * num_scales(QType);
  int64_t ahead[C];
  for (int c = 0; c < C; ++c) ahead[c] = std::min<int64_t>(n + c + kAheadRows, N - 1);
  for (int64_t b = 0; b < w.num_blocks; ++b) {
    Isa::V weights[C][kVecs];
    for (int c = 0; c < C; ++c) dequant<QType>(w, n + c, b, weights[c]);
    // Rows are short (a few hundred bytes): the hardware's stream prefetchers barely start on
    // one before it ends, and a product of one row waits on memory (2.5x slower measured on
    // cold weights). So ask for the row kAheadRows ahead of each of this tile's, a line at a time.
    if ((b * code_bytes(QType)) % 64 == 0)
      for (int c = 0; c < C; ++c) __builtin_prefetch(w.codes + ahead[c] * code_row + b * code_bytes(QType));
    if ((b * num_scales(QType) * 4) % 64 == 0)
      for (int c = 0; c < C; ++c) __builtin_prefetch(w.scales + ahead[c] * scale_row + b * num_scales(QType));
    for (int r = 0; r < R; ++r) {
      const float* xs = x + r * K + b * kBlock;
      for (int v = 0; v < kVecs; ++v) {
        const Isa::V xv = Isa::load(xs + v * Isa::kLanes);
        for (int c = 0; c < C; ++c) acc[r][c][v] = Isa::fmadd(weights[c][v], xv, acc[r][c][v]);
      }
    }
  }
  Isa::V totals[R * C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      totals[r * C + c] = acc[r][c][0];
      for (int v = 1; v < kVecs; ++v) totals[r * C + c] = totals[r * C + c] + acc[r][c][v];
    }
  lane_sums<R * C>(totals, [&](int i, float sum) { out[(i / C) * N + n + i % C] = sum; });
}

// Up to 8 rows of x against every output feature, the features split across threads.
template <int64_t QType, int R>
void rows(const float* x, int64_t K, const Weights& w, float* out, int64_t N) {
  constexpr int C = R == 1 ? 4 : (R <= 4 ? 2 : 1);
  constexpr int64_t kGrain = 64;  // output features a thread takes at least
  at::parallel_for(0, (N + C - 1) / C, kGrain / C, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i * C;
      if (n + C <= N) {
        tile<QType, R, C>(x, K, w, n, out, N);
      } else {
        for (int64_t m = n; m < N; ++m) tile<QType, R, 1>(x, K, w, m, out, N);
      }
    }
  });
}

// Many rows (a large decode batch): dequantizing each block once per 8 rows, as above, costs
// more than the arithmetic it feeds. So a thread dequantizes a panel of kPanel output features
// once, into a buffer of fp32 rows that stays in cache, and multiplies every row of x with it
// in tiles of kTileRows x kTileColumns: per vector of k, kTileRows + kTileColumns loads feed
// kTileRows * kTileColumns fused multiply-adds, each accumulator summed across its lanes once.
constexpr int kPanel = 16;
#if defined(__AVX512F__)
constexpr int kTileRows = 4, kTileColumns = 4;  // 16 accumulators of 32 registers
#else
constexpr int kTileRows = 2, kTileColumns = 4;  // 8 of 16 (AVX2)
#endif
// Rows from which panels beat dequantizing per tile of rows: SmolLM2's 121 products on two
// AVX-512 cores (a Xeon, both summing by Isa::sums) take 14.2 ms by tiles and 14.5 by panels at
// 10 rows, 15.8 and 16.1 at 12, 21.0 and 19.7 at 16, 30.7 by panels at 32 (oneDNN on the float
// weights: 38); built for AVX2 (measured on a Zen 4), 25.3 and 23.5 at 8 rows, 51.0 and 37.9
// at 16.
#if defined(__AVX512F__)
constexpr int64_t kPanelMinRows = 13;
#else
constexpr int64_t kPanelMinRows = 8;
#endif

template <int64_t QType>
void dequant_panel(const Weights& w, int64_t n0, int64_t K, float* panel) {
  for (int c = 0; c < kPanel; ++c)
    for (int64_t b = 0; b < w.num_blocks; ++b) {
      Isa::V v[kVecs];
      dequant<QType>(w, n0 + c, b, v);
      for (int i = 0; i < kVecs; ++i) Isa::store(panel + c * K + b * kBlock + i * Isa::kLanes, v[i]);
    }
}

template <int R>
void panel_tile(const float* x, int64_t K, const float* weights, float* out, int64_t N) {
  Isa::V acc[R][kTileColumns];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kTileColumns; ++c) acc[r][c] = Isa::zero();
  for (int64_t k = 0; k < K; k += Isa::kLanes) {
    Isa::V wv[kTileColumns];
    for (int c = 0; c < kTileColumns; ++c) wv[c] = Isa::load(weights + c * K + k);
    for (int r = 0; r < R; ++r) {
      const Isa::V xv = Isa::load(x + r * K + k);
      for (int c = 0; c < kTileColumns; ++c) acc[r][c] = Isa::fmadd(xv, wv[c], acc[r][c]);
    }
  }
  lane_sums<R * kTileColumns>(&acc[0][0], [&](int i, float sum) { out[(i / kTileColumns) * N + i % kTileColumns] = sum; });
}

template <int R>
void panel_tile_upto(const float* x, int64_t rows, int64_t K, const float* weights, float* out, int64_t N) {
  if constexpr (R > 1) {
    if (rows < R) return panel_tile_upto<R - 1>(x, rows, K, weights, out, N);
  }
  panel_tile<R>(x, K, weights, out, N);
}

template <int64_t QType>
void matmul_panels(const float* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N) {
  at::parallel_for(0, N / kPanel, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kPanel * K);
    for (int64_t p = begin; p < end; ++p) {
      dequant_panel<QType>(w, p * kPanel, K, panel.data());
      for (int64_t r = 0; r < M; r += kTileRows)
        for (int c = 0; c < kPanel; c += kTileColumns)
          panel_tile_upto<kTileRows>(x + r * K, std::min<int64_t>(kTileRows, M - r), K, panel.data() + c * K,
                                     out + r * N + p * kPanel + c, N);
    }
  });
}

template <int64_t QType>
void matmul_rows(const float* x, int64_t rows_left, int64_t K, const Weights& w, float* out, int64_t N) {
  while (rows_left > 0) {
    const int64_t r = std::min<int64_t>(rows_left, 8);
    switch (r) {
      case 1: rows<QType, 1>(x, K, w, out, N); break;
      case 2: rows<QType, 2>(x, K, w, out, N); break;
      case 3: rows<QType, 3>(x, K, w, out, N); break;
      case 4: rows<QType, 4>(x, K, w, out, N); break;
      case 5: rows<QType, 5>(x, K, w, out, N); break;
      case 6: rows<QType, 6>(x, K, w, out, N); break;
      case 7: rows<QType, 7>(x, K, w, out, N); break;
      default: rows<QType, 8>(x, K, w, out, N); break;
    }
    x += r * K;
    out += r * N;
    rows_left -= r;
  }
}

template <int64_t QType>
void matmul(const float* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N, bool panels) {
  if (panels) matmul_panels<QType>(x, M, K, w, out, N);
  else matmul_rows<QType>(x, M, K, w, out, N);
}

void matmul(int64_t qtype, const float* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N, bool panels) {
  if (qtype == kQ4_1) matmul<kQ4_1>(x, M, K, w, out, N, panels);
  else if (qtype == kQ6_K) matmul<kQ6_K>(x, M, K, w, out, N, panels);
  else matmul<kQ8_0>(x, M, K, w, out, N, panels);
}

Weights checked(const torch::Tensor& codes, const torch::Tensor& scales, int64_t qtype, int64_t in_features) {
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0 || qtype == kQ6_K, "GGUF type ", qtype,
              " is not supported (Q4_1 = 3, Q8_0 = 8, Q6_K = 14)");
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

// x [M, K] fp32 -> [M, N] fp32 against the N x K weights of type qtype; by panels from
// panel_min_rows rows (when N is a whole number of panels), by tiles of rows below (tests
// force either way).
torch::Tensor gguf_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype, int64_t panel_min_rows = kPanelMinRows) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "gguf_matmul takes fp32 rows [M, K]");
  const int64_t K = x.size(1), N = codes.size(0);
  const Weights w = checked(codes, scales, qtype, K);
  x = x.contiguous();
  auto out = torch::empty({x.size(0), N}, x.options());
  const bool panels = x.size(0) >= panel_min_rows && N % kPanel == 0;
  matmul(qtype, x.data_ptr<float>(), x.size(0), K, w, out.data_ptr<float>(), N, panels);
  return out;
}

// Features of the weight a thread multiplies into a buffer of its own at a time, for the argmax
// (a whole number of panels: the same products, panels or not, as gguf_matmul's).
constexpr int64_t kArgmaxGroup = 64 * kPanel;

// The first index of the row's largest value, as torch.argmax finds it: a NaN above any number.
int64_t row_argmax(const float* row, int64_t n) {
  Isa::V best = Isa::set1(-std::numeric_limits<float>::infinity());
  bool nan = false;
  int64_t i = 0;
  for (; i + Isa::kLanes <= n; i += Isa::kLanes) {
    const Isa::V v = Isa::load(row + i);
    nan = nan || Isa::any_nan(v);
    best = Isa::max(best, v);
  }
  float largest = Isa::max_of(best);
  for (; i < n; ++i) {
    nan = nan || row[i] != row[i];
    largest = std::max(largest, row[i]);
  }
  for (int64_t j = 0; j < n; ++j)
    if (nan ? row[j] != row[j] : row[j] == largest) return j;
  return 0;  // an empty row
}

// Whether a group's best beats the best of the groups before it (torch.argmax's order again).
inline bool beats(float value, float best) {
  return value > best || (value != value && best == best);
}

// Each row's greedy token: the index of its largest product, as torch.argmax of gguf_matmul's
// output would find it once the row's ``excluded`` ids ([M, E] int64, -1 for none) are set to
// -inf, without writing the [M, N] products: a thread computes a group of features into its
// buffer (gguf_matmul's very products: each output's sum runs in the same order whatever the
// group) and keeps the group's best per row; the groups' bests are then taken in order.
torch::Tensor gguf_matmul_argmax(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype, torch::Tensor excluded,
                                 int64_t panel_min_rows = kPanelMinRows) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "gguf_matmul_argmax takes fp32 rows [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const Weights w = checked(codes, scales, qtype, K);
  TORCH_CHECK(excluded.scalar_type() == torch::kInt64 && excluded.dim() == 2 && excluded.size(0) == M,
              "excluded ids must be int64 [", M, ", E]");
  x = x.contiguous();
  excluded = excluded.contiguous();
  const float* xs = x.data_ptr<float>();
  const int64_t* ids = excluded.data_ptr<int64_t>();
  const int64_t num_excluded = excluded.size(1);
  const bool panels = M >= panel_min_rows && N % kPanel == 0;
  const int64_t num_groups = (N + kArgmaxGroup - 1) / kArgmaxGroup;
  std::vector<float> group_best(num_groups * M);
  std::vector<int64_t> group_index(num_groups * M);
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> products(M * kArgmaxGroup);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kArgmaxGroup, width = std::min(kArgmaxGroup, N - n0);
      const Weights part{w.codes + n0 * w.num_blocks * code_bytes(qtype), w.scales + n0 * w.num_blocks * num_scales(qtype),
                         w.num_blocks};
      matmul(qtype, xs, M, K, part, products.data(), width, panels);
      for (int64_t r = 0; r < M; ++r) {
        float* row = products.data() + r * width;
        for (int64_t e = 0; e < num_excluded; ++e) {
          const int64_t id = ids[r * num_excluded + e];
          if (id >= n0 && id < n0 + width) row[id - n0] = -std::numeric_limits<float>::infinity();
        }
        const int64_t best = row_argmax(row, width);
        group_best[g * M + r] = row[best];
        group_index[g * M + r] = n0 + best;
      }
    }
  });
  auto out = torch::empty({M}, torch::kInt64);
  int64_t* tokens = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    int64_t best = 0;
    for (int64_t g = 1; g < num_groups; ++g)
      if (beats(group_best[g * M + r], group_best[best * M + r])) best = g;
    tokens[r] = group_index[best * M + r];
  }
  return out;
}

// The weights as the matmul sees them, [N, in_features] fp32: what the loader and the tests
// compare with the float weights gguf's dequantizer made.
torch::Tensor gguf_dequantize(torch::Tensor codes, torch::Tensor scales, int64_t qtype, int64_t in_features) {
  const Weights w = checked(codes, scales, qtype, in_features);
  const int64_t N = codes.size(0);
  auto out = torch::empty({N, in_features}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    Isa::V v[kVecs];
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < w.num_blocks; ++b) {
        if (qtype == kQ4_1) dequant<kQ4_1>(w, n, b, v);
        else if (qtype == kQ6_K) dequant<kQ6_K>(w, n, b, v);
        else dequant<kQ8_0>(w, n, b, v);
        for (int i = 0; i < kVecs; ++i) Isa::store(o + n * in_features + b * kBlock + i * Isa::kLanes, v[i]);
      }
  });
  return out;
}

std::string isa() { return Isa::kName; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_matmul", &gguf_matmul, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("qtype"),
        py::arg("panel_min_rows") = kPanelMinRows);
  m.def("gguf_matmul_argmax", &gguf_matmul_argmax, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("qtype"),
        py::arg("excluded"), py::arg("panel_min_rows") = kPanelMinRows);
  m.def("gguf_dequantize", &gguf_dequantize);
  m.def("isa", &isa);
}
