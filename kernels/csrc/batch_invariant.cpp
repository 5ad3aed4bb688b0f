// Products for batch-invariant inference (``batch_invariant: true``, duet/models/batch_invariant.py):
// every output's sum runs over k in one fixed order, one fused multiply-add a k from zero,
// whatever the number of rows, where a row sits in the batch, or how many threads share the
// call. oneDNN and MKL choose their kernels, blockings and splits of k by the row count, so a
// row's product there changes in its last bits with what runs beside it.
//
// The weight is laid out once in panels of kWidth output features, [panel][k][feature]. Each
// thread takes whole panels (never a share of k) and multiplies a panel with tiles of up to
// kMaxRows rows by outer products: per k, two vectors of the panel's weights and a broadcast of
// each row's x feed two fused multiply-adds a row into accumulators that hold the outputs. A
// tile's rows do not meet: each row's arithmetic is the same whatever the tile's size. The
// panel (K * kWidth weights) stays in cache across the row tiles, so a decode step reads each
// weight from memory once. bf16 weights and rows are widened to fp32 exactly (a shift) and
// summed in fp32.
//
// Built in the GGUF extension, without -ffast-math: nothing may reassociate the sums.

#include "gguf_blocks.h"

#include <c10/util/BFloat16.h>

namespace duet_gguf {
namespace {

constexpr int64_t kWidth = 2 * Isa::kLanes;  // output features a panel
#if defined(__AVX512F__)
constexpr int kMaxRows = 12;  // 24 accumulators, 2 weight vectors and a broadcast: 27 of 32 registers
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMaxRows = 6;  // 12 accumulators, 2 weight vectors and a broadcast: 15 of 16 registers
#else
constexpr int kMaxRows = 4;
#endif

inline Isa::V load_weights(const float* p) { return Isa::load(p); }

inline Isa::V load_weights(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#else
  return static_cast<float>(*p);
#endif
}

// f(std::integral_constant<int, rows>) for 1 <= rows <= MaxRows.
template <int MaxRows, typename F>
inline void for_rows(int64_t rows, F&& f) {
  if constexpr (MaxRows > 1) {
    if (rows < MaxRows) return for_rows<MaxRows - 1>(rows, f);
  }
  f(std::integral_constant<int, MaxRows>{});
}

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

// out[r, 0..columns) = x[r, :] . the panel's features, for R rows (x rows K apart, out rows ldo apart).
template <typename T, int R>
void panel_tile(const T* x, int64_t K, const T* panel, float* out, int64_t ldo, int64_t columns) {
  Isa::V acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Isa::zero();
  for (int64_t k = 0; k < K; ++k) {
    const Isa::V w0 = load_weights(panel + k * kWidth), w1 = load_weights(panel + k * kWidth + Isa::kLanes);
    for (int r = 0; r < R; ++r) {
      const Isa::V xv = Isa::set1(widen(x[r * K + k]));
      acc[r][0] = Isa::fmadd(xv, w0, acc[r][0]);
      acc[r][1] = Isa::fmadd(xv, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if (columns == kWidth) {
      Isa::store(out + r * ldo, acc[r][0]);
      Isa::store(out + r * ldo + Isa::kLanes, acc[r][1]);
    } else {  // the last panel of a weight whose features are not a multiple of kWidth
      float row[kWidth];
      Isa::store(row, acc[r][0]);
      Isa::store(row + Isa::kLanes, acc[r][1]);
      std::memcpy(out + r * ldo, row, columns * sizeof(float));
    }
  }
}

template <typename T>
void products(const T* x, int64_t M, int64_t K, const T* panels, int64_t N, float* out) {
  const int64_t num_panels = (N + kWidth - 1) / kWidth;
  const int64_t num_tiles = (M + kMaxRows - 1) / kMaxRows, tile_rows = (M + num_tiles - 1) / num_tiles;
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const T* panel = panels + p * K * kWidth;
      const int64_t columns = std::min(kWidth, N - p * kWidth);
      for (int64_t r = 0; r < M; r += tile_rows)
        for_rows<kMaxRows>(std::min(tile_rows, M - r), [&](auto rows) {
          panel_tile<T, decltype(rows)::value>(x + r * K, K, panel, out + r * N + p * kWidth, N, columns);
        });
    }
  });
}

}  // namespace

int64_t invariant_panel_width() { return kWidth; }

// x [M, K] (fp32, or bf16 against bf16 panels) times the weights laid out in panels
// ([ceil(N / kWidth), K, kWidth], invariant_panel_width(), of x's dtype): [M, N] in fp32.
torch::Tensor invariant_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kWidth && panels.is_contiguous(),
              "batch-invariant products take x [rows, in] and panels [panels, in, ", kWidth, "]");
  TORCH_CHECK(x.scalar_type() == panels.scalar_type(), "x and the panels must share a dtype, got ", x.scalar_type(), " and ",
              panels.scalar_type());
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "batch-invariant products run on CPU tensors");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(panels.size(1) == K && panels.size(0) == (N + kWidth - 1) / kWidth, "the panels do not hold ", N, " x ", K,
              " weights");
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  if (M == 0) return out;
  if (x.scalar_type() == torch::kFloat32)
    products<float>(x.data_ptr<float>(), M, K, panels.data_ptr<float>(), N, out.data_ptr<float>());
  else if (x.scalar_type() == torch::kBFloat16)
    products<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), M, K, panels.data_ptr<c10::BFloat16>(), N, out.data_ptr<float>());
  else
    TORCH_CHECK(false, "batch-invariant products take fp32 or bf16, got ", x.scalar_type());
  return out;
}

}  // namespace duet_gguf
