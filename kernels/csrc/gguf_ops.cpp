// Matmuls over llama.cpp's quantized weight blocks, read as the GGUF file stores them.
//
// Each block of 32 weights is dequantized in registers and multiplied in fp32, so the weights
// a product uses are bit for bit those of gguf's own dequantizer: d * q is exact in fp32 (an
// fp16 scale times a 4- or 8-bit integer), and Q4_1's "+ m" rounds once, as gguf's does (an
// fma rounds d * q + m once too, and d * q has nothing to round). Only the bytes read shrink:
// 0.625 byte a weight for Q4_1 and 1.0625 for Q8_0, against 4 for fp32. A decode step of a few
// rows reads every weight once and computes little with it: its speed is the speed of reading
// the weights, which is what this buys.
//
// Built apart from cpu_ops.cpp, without -ffast-math: nothing may reassociate the dequantization.
// The widest vectors this CPU has are chosen at build time (-march=native on this machine):
// AVX-512, else AVX2 with FMA, else plain C++.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstring>
#include <string>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kQ4_1 = 3;  // GGML's type ids
constexpr int64_t kQ8_0 = 8;

int64_t block_bytes(int64_t qtype) {
  if (qtype == kQ4_1) return 20;  // fp16 d, fp16 m, 16 bytes of nibbles
  if (qtype == kQ8_0) return 34;  // fp16 d, 32 int8
  TORCH_CHECK(false, "GGUF type ", qtype, " is not supported (Q4_1 = 3, Q8_0 = 8)");
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; exact, as every fp16 is an fp32
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// One ISA's vectors: a block of 32 weights is kVecs vectors of kLanes floats.
#if defined(__AVX512F__)
struct Isa {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr const char* kName = "avx512";
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  // Element j of a Q4_1 block is the low nibble of byte j, element j + 16 its high nibble. The
  // 16 values a nibble can stand for, d * i + m, fill one vector; each weight is looked up in it
  // (vpermps reads the low 4 bits of each index: the high nibble needs no mask).
  static void q4_1(const uint8_t* block, V* w) {
    int32_t scales;  // fp16 d and m, side by side
    std::memcpy(&scales, block, 4);
    const V both = _mm512_cvtph_ps(_mm256_set1_epi32(scales));
    const V d = _mm512_shuffle_ps(both, both, 0x00), m = _mm512_shuffle_ps(both, both, 0x55);
    const V table = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), d, m);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    w[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(qs), table);
    w[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(qs, 4)), table);
  }
  static void q8_0(const uint8_t* block, V* w) {
    const V d = _mm512_set1_ps(half_at(block));
    for (int i = 0; i < 2; ++i) {
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * i));
      w[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(qs)), d);
    }
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Isa {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr const char* kName = "avx2";
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static V widen(__m128i bytes, bool is_signed) {
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
  }
  static void q4_1(const uint8_t* block, V* w) {
    const V d = _mm256_set1_ps(half_at(block)), m = _mm256_set1_ps(half_at(block + 2));
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(qs, mask), high = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
    w[0] = _mm256_fmadd_ps(widen(low, false), d, m);
    w[1] = _mm256_fmadd_ps(widen(_mm_srli_si128(low, 8), false), d, m);
    w[2] = _mm256_fmadd_ps(widen(high, false), d, m);
    w[3] = _mm256_fmadd_ps(widen(_mm_srli_si128(high, 8), false), d, m);
  }
  static void q8_0(const uint8_t* block, V* w) {
    const V d = _mm256_set1_ps(half_at(block));
    for (int i = 0; i < 4; ++i) {
      const __m128i qs = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * i));
      w[i] = _mm256_mul_ps(widen(qs, true), d);
    }
  }
};
#else
struct Isa {
  using V = float;
  static constexpr int kLanes = 1;
  static constexpr const char* kName = "scalar";
  static V zero() { return 0.0f; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V fmadd(V a, V b, V c) { return a * b + c; }
  static float sum(V v) { return v; }
  static void q4_1(const uint8_t* block, V* w) {
    const float d = half_at(block), m = half_at(block + 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(block[4 + j] & 0x0F) + m;
      w[j + 16] = d * static_cast<float>(block[4 + j] >> 4) + m;
    }
  }
  static void q8_0(const uint8_t* block, V* w) {
    const float d = half_at(block);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(block[2 + j]));
  }
};
#endif

constexpr int kVecs = kBlock / Isa::kLanes;

template <int64_t QType>
inline void dequant(const uint8_t* block, Isa::V* w) {
  if constexpr (QType == kQ4_1) Isa::q4_1(block, w);
  else Isa::q8_0(block, w);
}

// out[r, n] = sum_k x[r, k] * W[n, k] for R rows of x and C output features at a time, every
// block dequantized once for all R rows. R * C * kVecs accumulators stay in registers.
template <int64_t QType, int R, int C>
void tile(const float* x, int64_t K, const uint8_t* weights, int64_t row_bytes, int64_t n, float* out, int64_t N) {
  constexpr int64_t kBytes = QType == kQ4_1 ? 20 : 34;
  Isa::V acc[R][C][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) acc[r][c][v] = Isa::zero();
  const int64_t num_blocks = K / kBlock;
  for (int64_t b = 0; b < num_blocks; ++b) {
    Isa::V w[C][kVecs];
    for (int c = 0; c < C; ++c) dequant<QType>(weights + (n + c) * row_bytes + b * kBytes, w[c]);
    for (int r = 0; r < R; ++r) {
      const float* xs = x + r * K + b * kBlock;
      for (int v = 0; v < kVecs; ++v) {
        const Isa::V xv = Isa::load(xs + v * Isa::kLanes);
        for (int c = 0; c < C; ++c) acc[r][c][v] = Isa::fmadd(w[c][v], xv, acc[r][c][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      Isa::V total = acc[r][c][0];
      for (int v = 1; v < kVecs; ++v) total = total + acc[r][c][v];
      out[r * N + n + c] = Isa::sum(total);
    }
}

// Up to 8 rows of x against every output feature, the features split across threads.
template <int64_t QType, int R>
void rows(const float* x, int64_t K, const uint8_t* weights, int64_t row_bytes, float* out, int64_t N) {
  constexpr int C = R == 1 ? 4 : (R <= 4 ? 2 : 1);
  const int64_t grain = 64;
  at::parallel_for(0, (N + C - 1) / C, grain / C, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n = i * C;
      if (n + C <= N) {
        tile<QType, R, C>(x, K, weights, row_bytes, n, out, N);
      } else {
        for (int64_t m = n; m < N; ++m) tile<QType, R, 1>(x, K, weights, row_bytes, m, out, N);
      }
    }
  });
}

template <int64_t QType>
void matmul_rows(const float* x, int64_t rows_left, int64_t K, const uint8_t* weights, int64_t row_bytes, float* out, int64_t N) {
  while (rows_left > 0) {
    const int64_t r = std::min<int64_t>(rows_left, 8);
    switch (r) {
      case 1: rows<QType, 1>(x, K, weights, row_bytes, out, N); break;
      case 2: rows<QType, 2>(x, K, weights, row_bytes, out, N); break;
      case 3: rows<QType, 3>(x, K, weights, row_bytes, out, N); break;
      case 4: rows<QType, 4>(x, K, weights, row_bytes, out, N); break;
      case 5: rows<QType, 5>(x, K, weights, row_bytes, out, N); break;
      case 6: rows<QType, 6>(x, K, weights, row_bytes, out, N); break;
      case 7: rows<QType, 7>(x, K, weights, row_bytes, out, N); break;
      default: rows<QType, 8>(x, K, weights, row_bytes, out, N); break;
    }
    x += r * K;
    out += r * N;
    rows_left -= r;
  }
}

void check_weights(const torch::Tensor& weights, int64_t qtype, int64_t in_features) {
  TORCH_CHECK(weights.scalar_type() == torch::kUInt8 && weights.dim() == 2 && weights.is_contiguous(),
              "GGUF weights are a contiguous uint8 tensor [out_features, blocks * block bytes]");
  TORCH_CHECK(in_features % kBlock == 0, "in_features must be a multiple of ", kBlock);
  TORCH_CHECK(weights.size(1) == in_features / kBlock * block_bytes(qtype), "GGUF weights of ", weights.size(1),
              " bytes a row do not hold ", in_features, " weights of type ", qtype);
}

// x [M, K] fp32 -> [M, N] fp32 against the N x K weights stored as GGUF blocks of type qtype.
torch::Tensor gguf_matmul(torch::Tensor x, torch::Tensor weights, int64_t qtype) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "gguf_matmul takes fp32 rows [M, K]");
  const int64_t K = x.size(1), N = weights.size(0);
  check_weights(weights, qtype, K);
  x = x.contiguous();
  auto out = torch::empty({x.size(0), N}, x.options());
  const float* xs = x.data_ptr<float>();
  const uint8_t* w = weights.data_ptr<uint8_t>();
  if (qtype == kQ4_1) matmul_rows<kQ4_1>(xs, x.size(0), K, w, weights.size(1), out.data_ptr<float>(), N);
  else matmul_rows<kQ8_0>(xs, x.size(0), K, w, weights.size(1), out.data_ptr<float>(), N);
  return out;
}

// The weights as the matmul sees them, [N, in_features] fp32: what the tests compare with gguf's dequantizer.
torch::Tensor gguf_dequantize(torch::Tensor weights, int64_t qtype, int64_t in_features) {
  check_weights(weights, qtype, in_features);
  const int64_t N = weights.size(0), bytes = block_bytes(qtype), row_bytes = weights.size(1);
  auto out = torch::empty({N, in_features}, torch::kFloat32);
  const uint8_t* w = weights.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    Isa::V v[kVecs];
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < in_features / kBlock; ++b) {
        const uint8_t* block = w + n * row_bytes + b * bytes;
        if (qtype == kQ4_1) dequant<kQ4_1>(block, v);
        else dequant<kQ8_0>(block, v);
        for (int i = 0; i < kVecs; ++i) Isa::store(o + n * in_features + b * kBlock + i * Isa::kLanes, v[i]);
      }
  });
  return out;
}

std::string isa() { return Isa::kName; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_matmul", &gguf_matmul);
  m.def("gguf_dequantize", &gguf_dequantize);
  m.def("isa", &isa);
}
