// CPU kernels for the decode hot path: each replaces a chain of small torch ops whose
// per-call overhead (~3-25 us each on small tensors) dominated a decode step. This file holds
// the norms, RoPE with the KV-cache write, the activation and the token masks, and binds every
// kernel of the extension to Python; attention is in paged_attention.cpp (decode rows) and
// prompt_attention.cpp (prompt chunks).
// Built at first use with -O3 -march=native, so the compiler vectorises the inner loops
// for whatever this CPU has (AVX2, AVX-512). fp32 and bf16 tensors; maths in fp32. KV caches
// may also hold one-byte codes (int8, fp8 e4m3) with a power-of-two scale per row (kv_quant.py).

#include "cpu_ops.h"
#include "kv_rows.h"
#include "bf16_lanes.h"

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// residual += x (rounded to the model dtype, as transformers does), then
// x = weight * normalise(residual), normalised in fp32 and rounded before the weight.
// With add_residual=false, x = weight * normalise(x) and residual is unused.
template <typename scalar_t>
void rms_norm_kernel(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps,
                     bool add_residual) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  scalar_t* x_ptr = x.data_ptr<scalar_t>();
  scalar_t* r_ptr = add_residual ? residual.data_ptr<scalar_t>() : nullptr;
  const scalar_t* w_ptr = weight.data_ptr<scalar_t>();
  const float eps_f = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> h(hidden);
    for (int64_t row = begin; row < end; ++row) {
      scalar_t* xr = x_ptr + row * hidden;
      float sum_sq = 0.f;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (hidden % 16 == 0) {
          bf16_rms_norm_row(xr, add_residual ? r_ptr + row * hidden : nullptr, w_ptr, hidden, eps_f);
          continue;
        }
      }
#endif
      if (add_residual) {
        scalar_t* rr = r_ptr + row * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          rr[i] = from_float<scalar_t>(to_float(rr[i]) + to_float(xr[i]));
          h[i] = to_float(rr[i]);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) h[i] = to_float(xr[i]);
      }
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < hidden; ++i) sum_sq += h[i] * h[i];
      const float inv = 1.f / std::sqrt(sum_sq / hidden + eps_f);
      for (int64_t i = 0; i < hidden; ++i) {
        const scalar_t normed = from_float<scalar_t>(h[i] * inv);
        xr[i] = from_float<scalar_t>(to_float(w_ptr[i]) * to_float(normed));
      }
    }
  });
}

// Rotate-half RoPE on q and k in place (fp32 maths), then store k and v at their slots. The
// tables' width is half the features rotated: a head's first 2 * width (all of it, or its rotary
// part; the rest pass as they are). With a quantized cache, q then moves into the cache's
// Hadamard basis: q @ H / b (kv_quant.rotate).
template <typename scalar_t, typename Rows>
void rope_and_cache_kernel(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& positions,
                           const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& key_cache,
                           torch::Tensor& value_cache, const torch::Tensor& slot_mapping) {
  const int64_t tokens = q.size(0), num_heads = q.size(1), num_kv_heads = k.size(1), head_dim = q.size(2);
  const int64_t half = cos.size(1);
  const int64_t block_size = key_cache.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const float* cos_ptr = cos.data_ptr<float>();
  const float* sin_ptr = sin.data_ptr<float>();
  scalar_t* q_ptr = q.data_ptr<scalar_t>();
  scalar_t* k_ptr = k.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v.data_ptr<scalar_t>();
  using cache_t = typename Rows::cache_t;
  cache_t* kc = static_cast<cache_t*>(key_cache.data_ptr());
  cache_t* vc = static_cast<cache_t*>(value_cache.data_ptr());
  const int64_t q_row = q.stride(0), q_head = q.stride(1), k_row = k.stride(0), k_head = k.stride(1);
  const int64_t v_row = v.stride(0), v_head = v.stride(1);
  const int64_t kv_head_stride = key_cache.stride(0), block_stride = key_cache.stride(1);
  const int64_t token_stride = key_cache.stride(2);
  const int64_t table_width = cos.size(1);

  auto rotate = [&](scalar_t* x, const float* c, const float* s) {
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
      x[i] = from_float<scalar_t>(x1 * c[i] - x2 * s[i]);
      x[i + half] = from_float<scalar_t>(x2 * c[i] + x1 * s[i]);
    }
  };
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos_ptr + pos[t] * table_width;
      const float* s = sin_ptr + pos[t] * table_width;
      for (int64_t h = 0; h < num_heads; ++h) {
        scalar_t* qh = q_ptr + t * q_row + h * q_head;
        rotate(qh, c, s);
        if constexpr (Rows::kScaled) to_cache_basis(qh, head_dim);
      }
      const int64_t slot = slots[t];
      const int64_t block = slot / block_size, offset = slot % block_size;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        scalar_t* kh = k_ptr + t * k_row + h * k_head;
        rotate(kh, c, s);
        const scalar_t* vh = v_ptr + t * v_row + h * v_head;
        cache_t* kd = kc + h * kv_head_stride + block * block_stride + offset * token_stride;
        cache_t* vd = vc + h * kv_head_stride + block * block_stride + offset * token_stride;
        Rows::store(kd, kh, head_dim);
        Rows::store(vd, vh, head_dim);
      }
    }
  });
}

// out = silu(x[:, :n]) * x[:, n:] (bf16_lanes.h says how it rounds, and why -0 below kSiluZeroBelow).
template <typename scalar_t>
void silu_and_mul_kernel(torch::Tensor& out, const torch::Tensor& x) {
  const int64_t rows = x.size(0), width = out.size(1);
  const scalar_t* x_ptr = x.data_ptr<scalar_t>();
  scalar_t* o_ptr = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* gate = x_ptr + row * 2 * width;
      const scalar_t* up = gate + width;
      scalar_t* dst = o_ptr + row * width;
      int64_t first = 0;  // of the outputs the loop below computes
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)
        for (; first + 16 <= width; first += 16)
          store_bf16(dst + first, silu_and_mul_16(gate + first, up + first));
#endif
#pragma omp simd
      for (int64_t i = first; i < width; ++i) {
        const float g = to_float(gate[i]);
        const scalar_t act = from_float<scalar_t>(g < kSiluZeroBelow ? -0.f : g / (1.f + expf(-g)));
        dst[i] = from_float<scalar_t>(to_float(act) * to_float(up[i]));
      }
    }
  });
}


}  // namespace

// The entry points: Python's (below) and the decoder stack's (decoder_stack.cpp).
namespace duet_cpu {

void rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps, bool add_residual) {
  TORCH_CHECK(x.is_contiguous() && (!add_residual || residual.is_contiguous()), "rms_norm needs contiguous rows");
  DUET_DISPATCH(x.scalar_type(), scalar_t, [&] { rms_norm_kernel<scalar_t>(x, residual, weight, eps, add_residual); });
}

void rope_and_cache(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions, torch::Tensor cos,
                    torch::Tensor sin, torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "q, k, v need a contiguous last dim");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(key_cache.size(-1) == q.size(2) || q.size(2) <= kMaxQuantizedHeadDim,
              "quantized KV rows are at most ", kMaxQuantizedHeadDim, " wide, got head_dim ", q.size(2));
  TORCH_CHECK(2 * cos.size(1) <= q.size(2) && cos.sizes() == sin.sizes(), "RoPE tables wider than half a head");
  DUET_DISPATCH(q.scalar_type(), scalar_t, [&] {
    dispatch_rows<scalar_t>(key_cache, [&](auto rows) {
      using Rows = decltype(rows);
      rope_and_cache_kernel<scalar_t, Rows>(q, k, v, positions, cos, sin, key_cache, value_cache, slot_mapping);
    });
  });
}

// -inf from its bits: under -ffast-math the compiler may assume no float is infinite, so the
// value is stored, never computed or compared.
template <typename scalar_t>
scalar_t negative_infinity();
template <>
float negative_infinity<float>() {
  const uint32_t bits = 0xFF800000u;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}
template <>
c10::BFloat16 negative_infinity<c10::BFloat16>() {
  return c10::BFloat16(0xFF80, c10::BFloat16::from_bits());
}

// logits[rows[i], t] = -inf wherever bit t of bitmask[i] is 0 (32 tokens a word, lowest bit
// first, as llguidance and xgrammar write them); a word with every bit set is skipped whole.
template <typename scalar_t>
void apply_token_bitmask_kernel(torch::Tensor& logits, const torch::Tensor& bitmask, const torch::Tensor& rows) {
  const int64_t num_rows = rows.size(0), vocab = logits.size(1), words = bitmask.size(1), stride = logits.stride(0);
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const uint32_t* mask_ptr = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  scalar_t* logits_ptr = logits.data_ptr<scalar_t>();
  const scalar_t forbidden = negative_infinity<scalar_t>();
  at::parallel_for(0, num_rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      scalar_t* dst = logits_ptr + row_ptr[i] * stride;
      const uint32_t* mask = mask_ptr + i * words;
      for (int64_t word = 0; word < words && word * 32 < vocab; ++word) {
        const uint32_t bits = mask[word];
        if (bits == 0xFFFFFFFFu) continue;
        const int64_t count = std::min<int64_t>(32, vocab - word * 32);
        for (int64_t bit = 0; bit < count; ++bit) {
          if (!((bits >> bit) & 1u)) dst[word * 32 + bit] = forbidden;
        }
      }
    }
  });
}

void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "apply_token_bitmask needs [rows, vocab] logits, contiguous rows");
  TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(), "the bitmask is contiguous int32 words");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.size(0) == bitmask.size(0), "one int64 row index per bitmask row");
  DUET_DISPATCH(logits.scalar_type(), scalar_t, [&] { apply_token_bitmask_kernel<scalar_t>(logits, bitmask, rows); });
}

void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(), "silu_and_mul needs contiguous tensors");
  DUET_DISPATCH(x.scalar_type(), scalar_t, [&] { silu_and_mul_kernel<scalar_t>(out, x); });
}

// Adds the DecoderStack class (decoder_stack.cpp) to the extension's Python module.
void bind_decoder_stack(pybind11::module& m);

}  // namespace duet_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace duet_cpu;
  m.def("paged_attention", &paged_attention);
  m.def("prompt_attention", &prompt_attention);
  m.def("prompt_attention_takes", &prompt_attention_takes);
  m.def("prompt_attention_amx", &prompt_attention_amx, "whether bf16 prompts over a bf16 cache go by AMX tiles here");
  m.def("set_prompt_attention_amx", &set_prompt_attention_amx, "switch AMX tiles for bf16 prompt attention (on only where permitted)");
  m.def("rms_norm", &rms_norm);
  m.def("rope_and_cache", &rope_and_cache);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("apply_token_bitmask", &apply_token_bitmask);
  m.def("lora_add", &lora_add);
  m.def("copy_blocks_sum", &copy_blocks_sum, "KV blocks copied, and the copied bytes' checksum",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  bind_decoder_stack(m);
}
