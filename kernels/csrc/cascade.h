// Cascade attention (Hydragen's and FlashInfer's "shared prefix" split): when several decode
// sequences share their first blocks (a system prompt or a document the prefix cache keeps once),
// their query rows attend to those blocks together, as two matrix products per KV head: the
// shared keys and values are read once for the group instead of once per row, and the products
// run at the GEMM's rate rather than the decode kernel's (which reuses a key only across the
// query heads of its KV head). Each row's part over the rest of its keys comes from the decode
// kernel (CascadeSuffix); the two parts merge by their log-sum-exps, as flash attention merges
// chunks of keys.
#pragma once

#include "cpu_ops.h"
#include "kv_rows.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

duet_cpu::CascadeSuffix cascade_suffix(int64_t num_heads, int64_t num_tokens, int64_t num_seqs, const duet_cpu::CascadeGroups& cascade) {
  duet_cpu::CascadeSuffix suffix;
  suffix.first.assign(num_seqs, 0);
  suffix.lse.assign(num_tokens * num_heads, 0.f);
  for (const auto& members : cascade) {
    TORCH_CHECK(members.size() >= 2 && members[0] > 0, "a cascade group is {prefix_tokens, sequences...}");
    for (size_t i = 1; i < members.size(); ++i) {
      TORCH_CHECK(members[i] >= 0 && members[i] < num_seqs, "a cascade group names sequence ", members[i], " of ", num_seqs);
      suffix.first[members[i]] = members[0];
    }
  }
  return suffix;
}

// Runs of consecutive blocks in a block table's first `num_blocks`: (first entry, length) each.
inline std::vector<std::pair<int64_t, int64_t>> block_runs(const int* table, int64_t num_blocks) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t b = 0; b < num_blocks; ++b) {
    if (!runs.empty() && table[b] == table[b - 1] + 1)
      ++runs.back().second;
    else
      runs.emplace_back(b, 1);
  }
  return runs;
}

// A group's shared keys or values of one KV head (`head`: that head's rows in the cache), as fp32
// matrices of rows [token, dim] that the products read: views of the cache's own runs of
// consecutive blocks where it holds fp32 rows in few enough runs (a product a run), else one
// matrix gathered into `buffer`, dequantized as the kernels read the rows.
template <typename Rows, typename Call>
std::vector<std::pair<int64_t, at::Tensor>> prefix_rows(const typename Rows::cache_t* head, const int* table, int64_t num_blocks,
                                                        const Call& call, at::Tensor& buffer) {
  constexpr int64_t kMaxViews = 8;  // past this many runs, one gathered matrix takes two products, not 2 a run
  const int64_t head_dim = call.head_dim, block_size = call.block_size;
  if constexpr (std::is_same_v<typename Rows::cache_t, float>) {
    const auto runs = block_runs(table, num_blocks);
    if (call.token_stride == head_dim && static_cast<int64_t>(runs.size()) <= kMaxViews) {
      std::vector<std::pair<int64_t, at::Tensor>> views;
      for (const auto& [first, length] : runs) {
        float* rows = const_cast<float*>(head + table[first] * call.block_stride);
        views.emplace_back(first * block_size, at::from_blob(rows, {length * block_size, head_dim}, at::kFloat));
      }
      return views;
    }
  }
  float* into = buffer.data_ptr<float>();
  at::parallel_for(0, num_blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const typename Rows::cache_t* block = head + table[b] * call.block_stride;
      if constexpr (std::is_same_v<typename Rows::cache_t, float>) {
        if (call.token_stride == head_dim) {
          std::memcpy(into + b * block_size * head_dim, block, sizeof(float) * block_size * head_dim);
          continue;
        }
      }
      for (int64_t t = 0; t < block_size; ++t) {
        const typename Rows::cache_t* row = block + t * call.token_stride;
        const float row_scale = Rows::scale(row, head_dim);
        float* dst = into + (b * block_size + t) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = Rows::value(row, d) * row_scale;
      }
    }
  });
  return {{0, buffer.narrow(0, 0, num_blocks * block_size)}};
}

// Each group's rows over its shared prefix, merged into `out` (which holds their attention over
// the keys past the prefix, with those scores' log-sum-exp in suffix.lse).
template <typename scalar_t, typename Rows>
void cascade_prefixes(const PagedCall<scalar_t, typename Rows::cache_t>& call, const duet_cpu::CascadeGroups& cascade,
                      double scale, const duet_cpu::CascadeSuffix& suffix) {
  const int64_t head_dim = call.head_dim, group = call.group;
  const float scale_f = static_cast<float>(scale);
  const auto floats = at::TensorOptions().dtype(at::kFloat);
  for (const auto& members : cascade) {
    const int64_t prefix = members[0];
    TORCH_CHECK(prefix % call.block_size == 0, "a cascade prefix is whole blocks, got ", prefix, " tokens");
    const int64_t num_blocks = prefix / call.block_size;
    const int* table = call.tables + members[1] * call.table_stride;
    std::vector<int64_t> rows;  // the group's query rows, sequence by sequence
    for (size_t i = 1; i < members.size(); ++i) {
      const int64_t s = members[i];
      TORCH_CHECK(call.context_len(s) >= prefix, "a cascade prefix must lie before its sequences' query rows");
      TORCH_CHECK(std::equal(table, table + num_blocks, call.tables + s * call.table_stride),
                  "a cascade group's sequences must share the prefix's blocks");
      for (int64_t row = call.starts[s]; row < call.starts[s + 1]; ++row) rows.push_back(row);
    }
    const int64_t num_rows = static_cast<int64_t>(rows.size()) * group;
    at::Tensor queries = at::empty({num_rows, head_dim}, floats);
    at::Tensor key_buffer = at::empty({prefix, head_dim}, floats), value_buffer = at::empty({prefix, head_dim}, floats);
    // Scores with a key a row and a query row a column: the products run about twice as fast
    // with the keys as the left operand here (MKL, 2-core Zen 3), and the softmax then runs
    // down the columns, vectors across the query rows.
    at::Tensor scores = at::empty({prefix, num_rows}, floats), attended = at::empty({num_rows, head_dim}, floats);
    std::vector<float> sums(num_rows), lse(num_rows);
    for (int64_t h = 0; h < call.num_kv_heads; ++h) {
      const auto keys = prefix_rows<Rows>(call.k_ptr + h * call.kv_head_stride, table, num_blocks, call, key_buffer);
      const auto values = prefix_rows<Rows>(call.v_ptr + h * call.kv_head_stride, table, num_blocks, call, value_buffer);
      float* q = queries.data_ptr<float>();
      for (size_t i = 0; i < rows.size(); ++i)
        for (int64_t g = 0; g < group; ++g) {
          const scalar_t* src = call.query_at(rows[i], h * group + g);
          float* dst = q + (i * group + g) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = to_float(src[d]) * scale_f;
        }
      for (const auto& [first, rows_of_run] : keys) {
        at::Tensor into = scores.narrow(0, first, rows_of_run.size(0));
        at::mm_out(into, rows_of_run, queries.t());
      }
      float* score_rows = scores.data_ptr<float>();
      constexpr int64_t kColumns = 4 * kLanes;  // query rows a task takes
      at::parallel_for(0, (num_rows + kColumns - 1) / kColumns, 1, [&](int64_t begin, int64_t end) {
        const int64_t first = begin * kColumns, last = std::min(num_rows, end * kColumns), width = last - first;
        std::vector<float> peak(width, -std::numeric_limits<float>::max()), sum(width, 0.f);
        for (int64_t t = 0; t < prefix; ++t) {
          const float* row = score_rows + t * num_rows + first;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) peak[c] = std::max(peak[c], row[c]);
        }
        for (int64_t t = 0; t < prefix; ++t) {
          float* row = score_rows + t * num_rows + first;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) {
            row[c] = expf(row[c] - peak[c]);
            sum[c] += row[c];
          }
        }
        for (int64_t c = 0; c < width; ++c) {
          sums[first + c] = sum[c];
          lse[first + c] = peak[c] + logf(sum[c]);
        }
      });
      attended.zero_();  // [rows, head_dim], unnormalised
      for (const auto& [first, rows_of_run] : values)
        attended.addmm_(scores.narrow(0, first, rows_of_run.size(0)).t(), rows_of_run);
      const float* weighted = attended.data_ptr<float>();
      for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t row = rows[r / group], head = h * group + r % group;
        const float suffix_lse = suffix.lse[row * call.num_heads + head];
        const float peak = std::max(lse[r], suffix_lse);
        const float prefix_weight = expf(lse[r] - peak), suffix_weight = expf(suffix_lse - peak);
        const float inv = 1.f / (prefix_weight + suffix_weight);
        const float from_prefix = prefix_weight * inv / sums[r], from_suffix = suffix_weight * inv;
        scalar_t* dst = call.out_at(row, head);
        for (int64_t d = 0; d < head_dim; ++d)
          dst[d] = from_float<scalar_t>(weighted[r * head_dim + d] * from_prefix + to_float(dst[d]) * from_suffix);
      }
    }
  }
}

}  // namespace
