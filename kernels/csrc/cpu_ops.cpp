// CPU kernels for the decode hot path: each replaces a chain of small torch ops whose
// per-call overhead (~3-25 us each on small tensors) dominated a decode step.
// Built at first use with -O3 -march=native, so the compiler vectorises the inner loops
// for whatever this CPU has (AVX2, AVX-512). fp32 and bf16 tensors; maths in fp32. KV caches
// may also hold one-byte codes (int8, fp8 e4m3) with a power-of-two scale per row (kv_quant.py).

#include "cpu_ops.h"
#include "kv_rows.h"
#include "cascade.h"
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

// The first key a query row sees: with a sliding window (window > 0) of `window` keys, itself
// included, the last `window` of the `visible` ones.
inline int64_t first_key(int64_t visible, int64_t window) { return window > 0 ? std::max<int64_t>(0, visible - window) : 0; }

// Causal attention over paged KV for every query row of the sequences seq_ids names, the
// tensors as PagedCall (kv_rows.h) reads them; for any head size and group.
template <typename scalar_t, typename Rows>
void paged_attention_kernel(const PagedCall<scalar_t, typename Rows::cache_t>& call, const std::vector<int64_t>& seq_ids,
                            double scale, int64_t window) {
  using cache_t = typename Rows::cache_t;
  const int64_t head_dim = call.head_dim, num_kv_heads = call.num_kv_heads, group = call.group;

  // One work item per (sequence, query row, kv head): the kv head's K/V rows are read once
  // for all `group` query heads that share them.
  std::vector<int64_t> item_seq, item_row;
  call.query_rows(seq_ids, item_seq, item_row);
  const int64_t num_items = static_cast<int64_t>(item_seq.size()) * num_kv_heads;
  const float scale_f = static_cast<float>(scale);

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item_seq[item / num_kv_heads], row = item_row[item / num_kv_heads];
      const int64_t h = item % num_kv_heads;
      const int64_t end_key = call.context_len(s) + (row - call.starts[s]) + 1, first = first_key(end_key, window);
      const int64_t visible = end_key - first;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = call.query_at(row, h * group + g);
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = to_float(src[d]) * scale_f;
      }
      scores.resize(group * visible);
      for (int64_t t = 0; t < visible; ++t) {
        const cache_t* k = call.k_ptr + call.kv_offset(s, h, first + t);
        const float k_scale = Rows::scale(k, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * Rows::value(k, d);
          scores[g * visible + t] = dot * k_scale;
        }
      }
      std::vector<float> denom(group);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * visible;
        const float peak = *std::max_element(sg, sg + visible);
        float sum = 0.f;
        for (int64_t t = 0; t < visible; ++t) {
          sg[t] = expf(sg[t] - peak);
          sum += sg[t];
        }
        denom[g] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < visible; ++t) {
        const cache_t* v = call.v_ptr + call.kv_offset(s, h, first + t);
        const float v_scale = Rows::scale(v, head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * visible + t] * v_scale;
          float* ag = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * Rows::value(v, d);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = call.out_at(row, h * group + g);
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = from_float<scalar_t>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

// The decode (and verification) path of the attention above, for head_dim 64 or 128 (DV
// vectors) and up to kMaxGroup query heads a KV head, in gcc's vectors (kv_rows.h). Per work
// item (sequence, query row, KV head) it walks the visible tokens kLanes at a time, reading
// each key and value row once for all the query heads that share it: the kLanes dot products
// of a chunk are summed across their lanes together (a transpose-and-add tree: kLanes - 1 adds
// for kLanes tokens instead of one reduction each), and the softmax runs online (a running max
// and sum, the accumulator rescaled when the max grows), so no pass goes back over the scores
// and nothing is allocated per item.
constexpr int kMaxGroup = 8;

inline float lane_sum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// Lane t of the result: the sum of the lanes of p[t], for kLanes vectors p (overwritten). Each
// level adds the two halves of every lane group of two vectors into one: kLanes - 1 adds.
inline vf transpose_sum(vf* p) {
#if defined(__AVX512F__)
  for (int i = 0; i < 8; ++i) {  // 8 lanes a vector
    const vf a = p[2 * i], b = p[2 * i + 1];
    p[i] = __builtin_shuffle(a, b, vi{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(a, b, vi{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  }
  for (int i = 0; i < 4; ++i) {  // 4 lanes a vector
    const vf a = p[2 * i], b = p[2 * i + 1];
    p[i] = __builtin_shuffle(a, b, vi{0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}) +
           __builtin_shuffle(a, b, vi{4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31});
  }
  for (int i = 0; i < 2; ++i) {  // 2 lanes a vector
    const vf a = p[2 * i], b = p[2 * i + 1];
    p[i] = __builtin_shuffle(a, b, vi{0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}) +
           __builtin_shuffle(a, b, vi{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31});
  }
  return __builtin_shuffle(p[0], p[1], vi{0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}) +
         __builtin_shuffle(p[0], p[1], vi{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31});
#else
  for (int i = 0; i < 4; ++i) {  // 4 lanes a vector
    const vf a = p[2 * i], b = p[2 * i + 1];
    p[i] = __builtin_shuffle(a, b, vi{0, 1, 2, 3, 8, 9, 10, 11}) + __builtin_shuffle(a, b, vi{4, 5, 6, 7, 12, 13, 14, 15});
  }
  for (int i = 0; i < 2; ++i) {  // 2 lanes a vector
    const vf a = p[2 * i], b = p[2 * i + 1];
    p[i] = __builtin_shuffle(a, b, vi{0, 1, 4, 5, 8, 9, 12, 13}) + __builtin_shuffle(a, b, vi{2, 3, 6, 7, 10, 11, 14, 15});
  }
  return __builtin_shuffle(p[0], p[1], vi{0, 2, 4, 6, 8, 10, 12, 14}) + __builtin_shuffle(p[0], p[1], vi{1, 3, 5, 7, 9, 11, 13, 15});
#endif
}

// With a `suffix` (cascade attention, cascade.h), a sequence's rows see only the keys
// from its suffix.first[s] on, and each row's log-sum-exp of its scores goes to suffix.lse.
template <typename scalar_t, typename Rows, int DV>
void decode_attention_kernel(const PagedCall<scalar_t, typename Rows::cache_t>& call, const std::vector<int64_t>& seq_ids,
                             double scale, int64_t window, duet_cpu::CascadeSuffix* suffix = nullptr) {
  using cache_t = typename Rows::cache_t;
  const int64_t head_dim = call.head_dim, num_kv_heads = call.num_kv_heads;
  const int group = static_cast<int>(call.group);
  const float scale_f = static_cast<float>(scale);
  const int64_t row_bytes = call.token_stride * static_cast<int64_t>(sizeof(cache_t));

  std::vector<int64_t> item_seq, item_row;
  call.query_rows(seq_ids, item_seq, item_row);
  const int64_t num_items = static_cast<int64_t>(item_seq.size()) * num_kv_heads;

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    vf q[kMaxGroup][DV], acc[kMaxGroup][DV], partial[kMaxGroup][kLanes];
    float peak[kMaxGroup], denom[kMaxGroup];
    alignas(64) float probs[kMaxGroup][kLanes];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item_seq[item / num_kv_heads], row = item_row[item / num_kv_heads];
      const int64_t h = item % num_kv_heads;
      const int64_t visible = call.context_len(s) + (row - call.starts[s]) + 1;
      const int64_t first = suffix ? std::max(first_key(visible, window), suffix->first[s]) : first_key(visible, window);
      for (int g = 0; g < group; ++g) {
        const scalar_t* src = call.query_at(row, h * group + g);
        for (int j = 0; j < DV; ++j) {
          q[g][j] = load_lanes(src + j * kLanes) * scale_f;
          acc[g][j] = vf{};
        }
        peak[g] = -std::numeric_limits<float>::max();
        denom[g] = 0.f;
      }
      const cache_t* k_head = call.k_ptr + h * call.kv_head_stride;
      const cache_t* v_head = call.v_ptr + h * call.kv_head_stride;
      const int* table = call.tables + s * call.table_stride;
      // Row offsets of this chunk's tokens and of the next one's, placed once each by walking
      // the block table. The next chunk's rows lie wherever the table put them, where the
      // hardware prefetchers cannot guess: they are asked for while this chunk computes.
      int64_t offsets[2][kLanes];
      int64_t block = first / call.block_size, slot = first % call.block_size;  // where the next token to place lies
      auto place = [&](int64_t* into, int64_t count) {
        for (int64_t t = 0; t < count; ++t) {
          into[t] = table[block] * call.block_stride + slot * call.token_stride;
          if (++slot == call.block_size) {
            slot = 0;
            ++block;
          }
        }
      };
      place(offsets[0], std::min<int64_t>(kLanes, visible - first));
      for (int64_t t0 = first, current = 0; t0 < visible; t0 += kLanes, current ^= 1) {
        const int n = static_cast<int>(std::min<int64_t>(kLanes, visible - t0));
        const int64_t* rows = offsets[current];
        int64_t* next = offsets[current ^ 1];
        const int64_t num_next = std::clamp<int64_t>(visible - t0 - kLanes, 0, kLanes);
        place(next, num_next);
        for (int64_t t = 0; t < num_next; ++t)
          for (int64_t line = 0; line < row_bytes; line += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(k_head + next[t]) + line);
            __builtin_prefetch(reinterpret_cast<const char*>(v_head + next[t]) + line);
          }
        for (int t = 0; t < kLanes; ++t) {
          if (t >= n) {
            for (int g = 0; g < group; ++g) partial[g][t] = vf{};
            continue;
          }
          vf k[DV];
          for (int j = 0; j < DV; ++j) k[j] = Rows::lanes(k_head + rows[t] + j * kLanes);
          for (int g = 0; g < group; ++g) {
            vf dot = q[g][0] * k[0];
            for (int j = 1; j < DV; ++j) dot += q[g][j] * k[j];
            partial[g][t] = dot;
          }
        }
        vf k_scales;  // each token's key scale, applied to its scores (lanes past n: scores are 0)
        if constexpr (Rows::kScaled)
          for (int t = 0; t < kLanes; ++t) k_scales[t] = t < n ? Rows::scale(k_head + rows[t], head_dim) : 1.f;
        for (int g = 0; g < group; ++g) {
          vf scores = transpose_sum(partial[g]);
          if constexpr (Rows::kScaled) scores *= k_scales;
          float chunk_peak = peak[g];
          for (int t = 0; t < n; ++t) chunk_peak = std::max(chunk_peak, scores[t]);
          const float rescale = expf(peak[g] - chunk_peak);
          peak[g] = chunk_peak;
          float* p = probs[g];
#pragma omp simd
          for (int t = 0; t < kLanes; ++t) p[t] = expf(scores[t] - chunk_peak);
          for (int t = n; t < kLanes; ++t) p[t] = 0.f;
          denom[g] = denom[g] * rescale + lane_sum(load_lanes(p));
          for (int j = 0; j < DV; ++j) acc[g][j] *= rescale;
        }
        for (int t = 0; t < n; ++t) {
          vf v[DV];
          for (int j = 0; j < DV; ++j) v[j] = Rows::lanes(v_head + rows[t] + j * kLanes);
          const float v_scale = Rows::scale(v_head + rows[t], head_dim);
          for (int g = 0; g < group; ++g) {
            const float p = probs[g][t] * v_scale;
            for (int j = 0; j < DV; ++j) acc[g][j] += p * v[j];
          }
        }
      }
      for (int g = 0; g < group; ++g) {
        scalar_t* dst = call.out_at(row, h * group + g);
        const float inv = 1.f / denom[g];
        for (int j = 0; j < DV; ++j) {
          const vf o = acc[g][j] * inv;
          for (int i = 0; i < kLanes; ++i) dst[j * kLanes + i] = from_float<scalar_t>(o[i]);
        }
        if (suffix) suffix->lse[row * call.num_heads + h * group + g] = peak[g] + logf(denom[g]);
      }
    }
  });
}

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

void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                     torch::Tensor block_tables, torch::Tensor seq_lens, torch::Tensor query_start_loc,
                     std::vector<int64_t> seq_ids, double scale, int64_t window, const CascadeGroups& cascade) {
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out need a contiguous last dim");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type(), "key and value caches must share a dtype");
  const int64_t head_dim = query.size(2), group = query.size(1) / key_cache.size(0);
  // Cascade where the decode kernel serves the rows and no window narrows what they see.
  const bool cascades = !cascade.empty() && window == 0 && group <= kMaxGroup && (head_dim == 64 || head_dim == 128);
  DUET_DISPATCH(query.scalar_type(), scalar_t, [&] {
    dispatch_rows<scalar_t>(key_cache, [&](auto rows) {
      using Rows = decltype(rows);
      const PagedCall<scalar_t, typename Rows::cache_t> call(out, query, key_cache, value_cache, block_tables, seq_lens,
                                                             query_start_loc);
      if (cascades) {
        CascadeSuffix suffix = cascade_suffix(call.num_heads, query.size(0), seq_lens.size(0), cascade);
        if (head_dim == 64)
          decode_attention_kernel<scalar_t, Rows, 64 / kLanes>(call, seq_ids, scale, window, &suffix);
        else
          decode_attention_kernel<scalar_t, Rows, 128 / kLanes>(call, seq_ids, scale, window, &suffix);
        cascade_prefixes<scalar_t, Rows>(call, cascade, scale, suffix);
      } else if (group <= kMaxGroup && head_dim == 64)
        decode_attention_kernel<scalar_t, Rows, 64 / kLanes>(call, seq_ids, scale, window);
      else if (group <= kMaxGroup && head_dim == 128)
        decode_attention_kernel<scalar_t, Rows, 128 / kLanes>(call, seq_ids, scale, window);
      else
        paged_attention_kernel<scalar_t, Rows>(call, seq_ids, scale, window);
    });
  });
}

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
  bind_decoder_stack(m);
}
