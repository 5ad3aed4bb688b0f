// Each row's greedy token straight from a product over GGUF weights (the LM head's), without
// writing the [rows, vocabulary] logits: gguf_ops.cpp's products of fp32 rows and gguf_bf16.cpp's
// of bf16 rows, a group of features at a time, and torch.argmax's choice over them.

#include "gguf_blocks.h"

#include <c10/util/BFloat16.h>

#include <optional>

namespace duet_gguf {

// gguf_ops.cpp's products of fp32 rows, and its rule for panels (-1: the process's).
void matmul(int64_t qtype, const float* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N, bool panels);
bool by_panels(const Weights& w, int64_t M, int64_t N, int64_t panel_min_rows);

// gguf_bf16.cpp's products of bf16 rows (fp32 sums, before rounding), and its rule for panels.
void bf16_products(const uint16_t* x, int64_t M, int64_t K, int64_t qtype, const Weights& w, float* out, int64_t N, int way);
int bf16_way(const Weights& w, int64_t M, int64_t panel_min_rows);

// values[i] rounded to bf16 and back, as torch's .to(torch.bfloat16) rounds (to nearest even,
// denormals kept, a NaN to the quiet NaN 0x7FC0).
void round_to_bf16(float* values, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF), high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(values + i);
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), one), half);
    __m512i rounded = _mm512_and_si512(_mm512_add_epi32(u, bias), high);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
    _mm512_storeu_ps(values + i, _mm512_castsi512_ps(rounded));
  }
#endif
  for (; i < n; ++i) values[i] = static_cast<float>(c10::BFloat16(values[i]));
}

// Features of the weight a thread multiplies into a buffer of its own at a time, for the argmax
// (a whole number of panels: the same products, panels or not, as gguf_matmul's).
constexpr int64_t kArgmaxGroup = 64 * kPanelWidth;

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
// output (of bf16 rows: gguf_matmul_bf16's, rounded to bf16) would find it once the row's
// ``excluded`` ids ([M, E] int64, -1 for none) are set to -inf, without writing the [M, N]
// products: a thread computes a group of features into its buffer (the very products: each
// output's sum runs in the same order whatever the group) and keeps the group's best per row;
// the groups' bests are then taken in order.
torch::Tensor gguf_matmul_argmax(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype, torch::Tensor excluded,
                                 int64_t panel_min_rows, std::optional<torch::Tensor> panel_codes,
                                 std::optional<torch::Tensor> panel_scales) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((x.scalar_type() == torch::kFloat32 || bf16) && x.dim() == 2, "gguf_matmul_argmax takes fp32 or bf16 rows [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const Weights w = with_layout(checked(codes, scales, qtype, K), qtype, N, panel_codes, panel_scales);
  TORCH_CHECK(excluded.scalar_type() == torch::kInt64 && excluded.dim() == 2 && excluded.size(0) == M,
              "excluded ids must be int64 [", M, ", E]");
  x = x.contiguous();
  excluded = excluded.contiguous();
  const float* xs = bf16 ? nullptr : x.data_ptr<float>();
  const auto* xs16 = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()) : nullptr;
  const int64_t* ids = excluded.data_ptr<int64_t>();
  const int64_t num_excluded = excluded.size(1);
  const bool panels = !bf16 && by_panels(w, M, N, panel_min_rows);
  const int bf16_ways = bf16 ? bf16_way(w, M, panel_min_rows) : kBf16Tiles;
  const int64_t num_groups = (N + kArgmaxGroup - 1) / kArgmaxGroup;
  std::vector<float> group_best(num_groups * M);
  std::vector<int64_t> group_index(num_groups * M);
  at::parallel_for(0, num_groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> products(M * kArgmaxGroup);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kArgmaxGroup, width = std::min(kArgmaxGroup, N - n0);
      Weights part{w.codes + n0 * w.num_blocks * code_bytes(qtype), w.scales + n0 * w.num_blocks * num_scales(qtype),
                   w.num_blocks};
      if (w.panel_codes != nullptr) {  // the group's panels (n0 is a multiple of 32)
        part.panel_codes = w.panel_codes + n0 * w.num_blocks * panel_code_bytes(qtype);
        part.panel_scales = w.panel_scales + n0 * w.num_blocks * num_scales(qtype);
      }
      if (bf16) {
        bf16_products(xs16, M, K, qtype, part, products.data(), width, bf16_ways);
        round_to_bf16(products.data(), M * width);
      } else {
        matmul(qtype, xs, M, K, part, products.data(), width, panels);
      }
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

}  // namespace duet_gguf
