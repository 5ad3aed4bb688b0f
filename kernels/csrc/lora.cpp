// LoRA updates added to a product's rows (duet/lora.py): y[i] += (x[i] A^T) B^T, with A and B
// those of row i's adapter, every row in one call. An adapter's A is [rank, in] and its B is
// stored transposed, [rank, out] (its scale folded in), fp32 or bf16 (widened as read; sums in
// fp32). An adapter's rows go in blocks of kRowBlock, each block reading the adapter's A and B^T
// once (not once a row: reading them is most of the work); the blocks are shared out among the
// threads. In a block, each row's rank values are dot products along `in`; then the rank terms
// are added to y: for several rows, kTileRows rows' 32-output chunks summed over the rank in
// registers (y read and written once, not once per rank term); for one row, B^T streamed rank
// row by rank row into it. x and y are fp32 or bf16 (a bf16 row is widened, updated in fp32 and
// rounded once).

#include "cpu_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace duet_cpu {

namespace {

constexpr int64_t kRowBlock = 8;  // rows of one adapter that share each read of its A and B^T

constexpr int64_t kTileRows = 4;  // rows whose outputs one pass over B^T's rank rows updates in registers

// Sixteen fp32 lanes as the compiler's generic vectors (one AVX-512 register, two AVX2 ones).
typedef float v16f __attribute__((vector_size(64)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

inline v16f load16(const float* p) {
  v16f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline v16f load16(const c10::BFloat16* p) {  // bf16 is fp32's high half
  v16u16 half;
  std::memcpy(&half, p, sizeof(half));
  const v16u32 wide = __builtin_convertvector(half, v16u32) << 16;
  v16f v;
  std::memcpy(&v, &wide, sizeof(v));
  return v;
}

inline void store16(float* p, v16f v) { std::memcpy(p, &v, sizeof(v)); }

// ys[r][o] += sum_k t[r * rank + k] * bt[k * out + o] for NR rows: each 32-output chunk of the
// NR rows is summed over the rank in registers, then written once (y is read and written once,
// not once per rank term).
template <int NR, typename weight_t>
void add_rank_terms(float* const* ys, const float* t, int64_t rank, const weight_t* bt, int64_t out) {
  int64_t o = 0;
  for (; o + 32 <= out; o += 32) {
    v16f low[NR], high[NR];
    for (int r = 0; r < NR; ++r) {
      low[r] = load16(ys[r] + o);
      high[r] = load16(ys[r] + o + 16);
    }
    for (int64_t k = 0; k < rank; ++k) {
      const v16f b_low = load16(bt + k * out + o), b_high = load16(bt + k * out + o + 16);
      for (int r = 0; r < NR; ++r) {
        const float tk = t[r * rank + k];
        low[r] += tk * b_low;
        high[r] += tk * b_high;
      }
    }
    for (int r = 0; r < NR; ++r) {
      store16(ys[r] + o, low[r]);
      store16(ys[r] + o + 16, high[r]);
    }
  }
  for (; o < out; ++o) {
    for (int r = 0; r < NR; ++r) {
      float sum = ys[r][o];
      for (int64_t k = 0; k < rank; ++k) sum += t[r * rank + k] * static_cast<float>(bt[k * out + o]);
      ys[r][o] = sum;
    }
  }
}

template <typename scalar_t, typename weight_t>
void lora_add_kernel(torch::Tensor& y, const torch::Tensor& x, const int32_t* slots, const std::vector<torch::Tensor>& a,
                     const std::vector<torch::Tensor>& bt, int64_t max_rank) {
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1), num_slots = static_cast<int64_t>(a.size());
  const scalar_t* x_data = x.data_ptr<scalar_t>();
  scalar_t* y_data = y.data_ptr<scalar_t>();
  // The rows of each adapter, in blocks: a block reads its adapter's A and B^T once for all its rows.
  std::vector<std::vector<int64_t>> by_slot(num_slots);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t slot = slots[i];
    if (slot >= 0 && slot < num_slots && a[slot].numel() > 0) by_slot[slot].push_back(i);
  }
  std::vector<std::array<int64_t, 3>> blocks;  // (slot, first, end) in by_slot[slot]
  for (int64_t slot = 0; slot < num_slots; ++slot) {
    const int64_t count = static_cast<int64_t>(by_slot[slot].size());
    for (int64_t first = 0; first < count; first += kRowBlock) blocks.push_back({slot, first, std::min(count, first + kRowBlock)});
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> t(kRowBlock * max_rank), x_rows, y_rows;
    if constexpr (!std::is_same_v<scalar_t, float>) {
      x_rows.resize(kRowBlock * in);
      y_rows.resize(kRowBlock * out);
    }
    const float* xs[kRowBlock];
    float* ys[kRowBlock];
    for (int64_t b = begin; b < end; ++b) {
      const auto [slot, first, last] = blocks[b];
      const int64_t n = last - first, rank = a[slot].size(0);
      const weight_t* a_data = a[slot].data_ptr<weight_t>();
      const weight_t* bt_data = bt[slot].data_ptr<weight_t>();
      for (int64_t r = 0; r < n; ++r) {
        const int64_t i = by_slot[slot][first + r];
        if constexpr (std::is_same_v<scalar_t, float>) {
          xs[r] = x_data + i * in;
          ys[r] = y_data + i * out;
        } else {
          for (int64_t j = 0; j < in; ++j) x_rows[r * in + j] = static_cast<float>(x_data[i * in + j]);
          for (int64_t o = 0; o < out; ++o) y_rows[r * out + o] = static_cast<float>(y_data[i * out + o]);
          xs[r] = x_rows.data() + r * in;
          ys[r] = y_rows.data() + r * out;
        }
      }
      for (int64_t k = 0; k < rank; ++k) {
        const weight_t* ak = a_data + k * in;
        for (int64_t r = 0; r < n; ++r) {
          const float* xi = xs[r];
          float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
          for (int64_t j = 0; j < in; ++j) acc += static_cast<float>(ak[j]) * xi[j];
          t[r * rank + k] = acc;
        }
      }
      if (n == 1) {  // one row: B^T streamed once, rank row by rank row, into the row (in cache throughout)
        for (int64_t k = 0; k < rank; ++k) {
          const weight_t* bk = bt_data + k * out;
          const float tk = t[k];
          float* yi = ys[0];
#pragma omp simd
          for (int64_t o = 0; o < out; ++o) yi[o] += tk * static_cast<float>(bk[o]);
        }
      } else {
        for (int64_t r = 0; r < n; r += kTileRows) {
          const int64_t rows_here = std::min(kTileRows, n - r);
          const float* tr = t.data() + r * rank;
          switch (rows_here) {
            case 4: add_rank_terms<4>(ys + r, tr, rank, bt_data, out); break;
            case 3: add_rank_terms<3>(ys + r, tr, rank, bt_data, out); break;
            case 2: add_rank_terms<2>(ys + r, tr, rank, bt_data, out); break;
            default: add_rank_terms<1>(ys + r, tr, rank, bt_data, out); break;
          }
        }
      }
      if constexpr (!std::is_same_v<scalar_t, float>) {
        for (int64_t r = 0; r < n; ++r) {
          const int64_t i = by_slot[slot][first + r];
          for (int64_t o = 0; o < out; ++o) y_data[i * out + o] = static_cast<scalar_t>(y_rows[r * out + o]);
        }
      }
    }
  });
}

}  // namespace

void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor row_slots, const std::vector<torch::Tensor>& a,
              const std::vector<torch::Tensor>& bt) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_add: x [rows, in] and y [rows, out]");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && x.scalar_type() == y.scalar_type(), "lora_add: contiguous x and y of one dtype");
  TORCH_CHECK(row_slots.scalar_type() == torch::kInt32 && row_slots.is_contiguous() && row_slots.numel() == x.size(0),
              "lora_add: one int32 adapter slot per row");
  TORCH_CHECK(a.size() == bt.size(), "lora_add: an A and a B^T per slot");
  int64_t max_rank = 0;
  std::optional<c10::ScalarType> weight_type;
  for (size_t slot = 0; slot < a.size(); ++slot) {
    if (a[slot].numel() == 0) continue;
    if (!weight_type) weight_type = a[slot].scalar_type();
    TORCH_CHECK(a[slot].scalar_type() == *weight_type && bt[slot].scalar_type() == *weight_type && a[slot].is_contiguous() &&
                    bt[slot].is_contiguous() && (*weight_type == torch::kFloat32 || *weight_type == torch::kBFloat16),
                "lora_add: contiguous A and B^T, all fp32 or all bf16");
    TORCH_CHECK(a[slot].dim() == 2 && a[slot].size(1) == x.size(1) && bt[slot].dim() == 2 && bt[slot].size(1) == y.size(1) &&
                    bt[slot].size(0) == a[slot].size(0), "lora_add: A [rank, in] and B^T [rank, out] fitting x and y");
    max_rank = std::max<int64_t>(max_rank, a[slot].size(0));
  }
  if (max_rank == 0) return;
  const int32_t* slots = row_slots.data_ptr<int32_t>();
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, "lora_add: fp32 or bf16 x and y");
  const bool float_rows = x.scalar_type() == torch::kFloat32, float_weights = *weight_type == torch::kFloat32;
  if (float_rows && float_weights) lora_add_kernel<float, float>(y, x, slots, a, bt, max_rank);
  else if (float_rows) lora_add_kernel<float, c10::BFloat16>(y, x, slots, a, bt, max_rank);
  else if (float_weights) lora_add_kernel<c10::BFloat16, float>(y, x, slots, a, bt, max_rank);
  else lora_add_kernel<c10::BFloat16, c10::BFloat16>(y, x, slots, a, bt, max_rank);
}

}  // namespace duet_cpu
