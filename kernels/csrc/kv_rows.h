// What the CPU attention kernels share (paged_attention.cpp, prompt_attention.cpp, cascade.h):
// gcc vectors of one register's fp32 lanes, and the rows of a KV cache as the kernels read and
// write them.
#pragma once

#include <torch/types.h>  // a third of torch/extension.h's compile time; only the binding files include that
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

template <typename T>
inline float to_float(T value) { return static_cast<float>(value); }

template <typename T>
inline T from_float(float value) { return static_cast<T>(value); }

// A vector is one AVX-512 register (16 fp32 lanes) where the CPU has them, else one AVX2
// register (8 lanes; plain code where there is none).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;  // AVX2 (16 lanes would cost cross-register shuffles there)
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int vi __attribute__((vector_size(4 * kLanes)));
typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));
typedef uint32_t vu __attribute__((vector_size(4 * kLanes)));

inline vf load_lanes(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vf load_lanes(const c10::BFloat16* p) {  // a bf16 is the top half of its fp32
  vh h;
  std::memcpy(&h, p, sizeof h);
  const vu bits = __builtin_convertvector(h, vu) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// The rows of a KV cache, as the kernels read and write them: floats as they are, or one-byte
// codes followed by their scale's byte (kv_quant.py): 6 bits of exponent E in [-32, 31] and 2
// of mantissa m, the scale 2^E (1 + m/4), chosen from the row's largest magnitude by the same
// integer rule on its float bits as the torch implementation.
constexpr int kMinScaleExponent = -32, kMaxScaleExponent = 31, kMantissaDropped = 21;

inline float decode_scale(uint8_t byte) {
  const uint32_t bits = (static_cast<uint32_t>((byte >> 2) + kMinScaleExponent + 127) << 23) |
                        (static_cast<uint32_t>(byte & 3) << kMantissaDropped);
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// The byte of target (the largest magnitude over the largest code), rounded up to 3 significant bits.
inline uint8_t encode_scale(float target) {
  uint32_t bits;
  std::memcpy(&bits, &target, sizeof bits);
  constexpr uint32_t low = (1u << kMantissaDropped) - 1;
  bits = (bits + low) & ~low;
  int exponent = static_cast<int>((bits >> 23) & 0xFF) - 127;
  int mantissa = static_cast<int>((bits >> kMantissaDropped) & 3);
  if (exponent < kMinScaleExponent) exponent = kMinScaleExponent, mantissa = 0;
  if (exponent > kMaxScaleExponent) exponent = kMaxScaleExponent, mantissa = 3;
  return static_cast<uint8_t>(((exponent - kMinScaleExponent) << 2) | mantissa);
}

template <typename T>
struct FloatRows {
  using cache_t = T;
  static constexpr bool kScaled = false;
  static float scale(const T*, int64_t) { return 1.f; }
  static float value(const T* row, int64_t d) { return to_float(row[d]); }
  static vf lanes(const T* p) { return load_lanes(p); }
  template <typename S>
  static void store(T* row, const S* src, int64_t head_dim) {
    for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<T>(to_float(src[d]));
  }
};

// Rows quantized, at most this wide (rope_and_cache checks it): the transform's buffer.
constexpr int64_t kMaxQuantizedHeadDim = 512;

// x @ H in place, H the Sylvester Hadamard matrix in blocks of head_dim's largest power-of-two
// divisor: butterflies (a + c, a - c) of elements h apart, h = 1, 2, 4, ... in the order of
// kv_quant.hadamard_rows, so both round alike.
inline void hadamard_rows(float* x, int64_t head_dim) {
  const int64_t block = head_dim & -head_dim;
  for (int64_t half = 1; half < block; half *= 2) {
    for (int64_t group = 0; group < head_dim; group += 2 * half) {
      for (int64_t i = group; i < group + half; ++i) {
        const float a = x[i], c = x[i + half];
        x[i] = a + c;
        x[i + half] = a - c;
      }
    }
  }
}

// A query row as x @ H / b, b the transform's block (a power of two: the division is exact).
template <typename scalar_t>
void to_cache_basis(scalar_t* row, int64_t head_dim) {
  float x[kMaxQuantizedHeadDim];
  for (int64_t d = 0; d < head_dim; ++d) x[d] = to_float(row[d]);
  hadamard_rows(x, head_dim);
  const float inverse_block = 1.f / static_cast<float>(head_dim & -head_dim);
  for (int64_t d = 0; d < head_dim; ++d) row[d] = from_float<scalar_t>(x[d] * inverse_block);
}

// Codes of the row's Hadamard transform and the scale's byte (kv_quant.py says why):
// Codec gives cache_t, kMaxCode and kPerCode (its reciprocal), decode (a code's value) and encode.
template <typename Codec>
struct ScaledRows {
  using cache_t = typename Codec::cache_t;
  static constexpr bool kScaled = true;
  static float scale(const cache_t* row, int64_t head_dim) { return decode_scale(static_cast<uint8_t>(row[head_dim])); }
  static float value(const cache_t* row, int64_t d) { return Codec::decode(row[d]); }
  static vf lanes(const cache_t* p) { return Codec::lanes(p); }
  template <typename S>
  static void store(cache_t* row, const S* src, int64_t head_dim) {
    float x[kMaxQuantizedHeadDim];
    for (int64_t d = 0; d < head_dim; ++d) x[d] = to_float(src[d]);
    hadamard_rows(x, head_dim);
    float amax = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(x[d]));
    const uint8_t scale_byte = encode_scale(amax * Codec::kPerCode);
    const float inverse = 1.f / decode_scale(scale_byte);
    for (int64_t d = 0; d < head_dim; ++d) row[d] = Codec::encode(std::clamp(x[d] * inverse, -Codec::kMaxCode, Codec::kMaxCode));
    row[head_dim] = static_cast<cache_t>(scale_byte);
  }
};

typedef int8_t vb __attribute__((vector_size(kLanes)));

struct Int8Codec {
  using cache_t = int8_t;
  static constexpr float kMaxCode = 127.f, kPerCode = 1.f / 127.f;
  static float decode(int8_t code) { return code; }
  static vf lanes(const int8_t* p) {
    vb codes;
    std::memcpy(&codes, p, sizeof codes);
    return __builtin_convertvector(codes, vf);
  }
  static int8_t encode(float x) { return static_cast<int8_t>(std::nearbyint(x)); }
};

struct Fp8Codec {
  using cache_t = uint8_t;  // the bits of torch.float8_e4m3fn
  static constexpr float kMaxCode = 448.f, kPerCode = 1.f / 448.f;  // e4m3's largest
  static const float* table() {
    static const std::vector<float> values = [] {
      std::vector<float> all(256);
      for (int bits = 0; bits < 256; ++bits)
        all[bits] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(bits), c10::Float8_e4m3fn::from_bits()));
      return all;
    }();
    return values.data();
  }
  static float decode(uint8_t code) { return table()[code]; }
  static vf lanes(const uint8_t* p) {
    const float* values = table();
    vf v;
    for (int i = 0; i < kLanes; ++i) v[i] = values[p[i]];
    return v;
  }
  static uint8_t encode(float x) { return c10::Float8_e4m3fn(x).x; }
};

// A paged attention call's tensors as its kernels read them. query/out: [tokens, heads,
// head_dim] (last dim contiguous); caches: [kv_heads, blocks, block_size, row] contiguous (a
// row: head_dim floats, or codes and their scale); block_tables [seqs, max_blocks], seq_lens
// [seqs], query_start_loc [seqs + 1], all int32. Row j of sequence s sits at position
// seq_lens[s] - query_len + j and sees positions 0..that position.
template <typename scalar_t, typename cache_t>
struct PagedCall {
  PagedCall(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
            const torch::Tensor& query_start_loc)
      : num_heads(query.size(1)), head_dim(query.size(2)), num_kv_heads(key_cache.size(0)),
        block_size(key_cache.size(2)), group(num_heads / num_kv_heads), tables(block_tables.data_ptr<int>()),
        table_stride(block_tables.stride(0)), lens(seq_lens.data_ptr<int>()), starts(query_start_loc.data_ptr<int>()),
        q_ptr(query.data_ptr<scalar_t>()), out_ptr(out.data_ptr<scalar_t>()),
        k_ptr(static_cast<const cache_t*>(key_cache.data_ptr())), v_ptr(static_cast<const cache_t*>(value_cache.data_ptr())),
        q_row(query.stride(0)), q_head(query.stride(1)), o_row(out.stride(0)), o_head(out.stride(1)),
        kv_head_stride(key_cache.stride(0)), block_stride(key_cache.stride(1)), token_stride(key_cache.stride(2)) {}

  int64_t query_len(int64_t s) const { return starts[s + 1] - starts[s]; }
  int64_t context_len(int64_t s) const { return lens[s] - query_len(s); }  // tokens before its query
  const scalar_t* query_at(int64_t row, int64_t head) const { return q_ptr + row * q_row + head * q_head; }
  scalar_t* out_at(int64_t row, int64_t head) const { return out_ptr + row * o_row + head * o_head; }

  // Where the row of KV head h for token `position` of sequence s lies, in either cache.
  int64_t kv_offset(int64_t s, int64_t h, int64_t position) const {
    return h * kv_head_stride + tables[s * table_stride + position / block_size] * block_stride +
           (position % block_size) * token_stride;
  }

  // (sequence, query row) of every query row of the sequences seq_ids names, in order.
  void query_rows(const std::vector<int64_t>& seq_ids, std::vector<int64_t>& seqs, std::vector<int64_t>& rows) const {
    for (int64_t s : seq_ids)
      for (int64_t row = starts[s]; row < starts[s + 1]; ++row) {
        seqs.push_back(s);
        rows.push_back(row);
      }
  }

  const int64_t num_heads, head_dim, num_kv_heads, block_size, group;
  const int* tables;
  const int64_t table_stride;
  const int* lens;    // tokens each sequence holds, its query's included
  const int* starts;  // each sequence's first query row
  const scalar_t* q_ptr;
  scalar_t* out_ptr;
  const cache_t* k_ptr;
  const cache_t* v_ptr;
  const int64_t q_row, q_head, o_row, o_head, kv_head_stride, block_stride, token_stride;
};

#define DUET_DISPATCH(DTYPE, NAME, ...)                                                          \
  if ((DTYPE) == torch::kFloat32) {                                                              \
    using NAME = float;                                                                          \
    __VA_ARGS__();                                                                               \
  } else if ((DTYPE) == torch::kBFloat16) {                                                      \
    using NAME = c10::BFloat16;                                                                  \
    __VA_ARGS__();                                                                               \
  } else {                                                                                       \
    TORCH_CHECK(false, "duet cpu_ops supports float32 and bfloat16, got ", DTYPE);               \
  }

// Calls body(Rows{}) with the rows a cache of this dtype holds for scalar_t queries: the same
// floats, or int8 / fp8 codes with their scales.
template <typename scalar_t, typename Body>
void dispatch_rows(const torch::Tensor& cache, Body&& body) {
  if (cache.scalar_type() == torch::kChar)
    body(ScaledRows<Int8Codec>{});
  else if (cache.scalar_type() == torch::kFloat8_e4m3fn)
    body(ScaledRows<Fp8Codec>{});
  else {
    TORCH_CHECK(cache.scalar_type() == c10::CppTypeToScalarType<scalar_t>::value,
                "a float KV cache must have the model's dtype, got ", cache.scalar_type());
    body(FloatRows<scalar_t>{});
  }
}

}  // namespace
