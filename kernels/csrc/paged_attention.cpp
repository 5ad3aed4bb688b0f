// Attention of decode rows (and any other query rows) over paged KV: the general causal kernel
// for any head size and group, and the decode path for heads of 64 or 128 (in gcc's vectors,
// kv_rows.h), with cascade attention's groups (cascade.h) served where it takes them. Prompt
// chunks go to prompt_attention.cpp. fp32 and bf16 queries; caches of fp32, bf16 or one-byte
// codes with a power-of-two scale per row (kv_quant.py); maths in fp32.

#include "cpu_ops.h"
#include "kv_rows.h"
#include "cascade.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
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

}  // namespace

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

}  // namespace duet_cpu
