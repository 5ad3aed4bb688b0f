// The panel products of GGUF blocks, with AVX-512 (gguf_blocks.h's panel layout): a panel of
// 32 output features dequantized once into a thread's buffer and multiplied with every row, for
// the fp32 kernels (gguf_ops.cpp's Fp32Panels) and the bf16 ones (gguf_bf16.cpp's Bf16Panels).

#pragma once

#include "gguf_blocks.h"

#if defined(__AVX512F__)
namespace duet_gguf {

// Block b of panel p, k by k: row(k, features 0-15's weights at k, features 16-31's), exactly
// the weights dequant gives (Q4_1, Q5_K and Q2_K: d * q + m by one fma; Q8_0 and Q6_K: d * q, exact;
// F8: its reading times 2^8 s, rounded once; Q8Z: (u - z) * s, rounded once).
template <int64_t QType, typename Row>
inline void panel_block(const Weights& w, int64_t p, int64_t b, Row&& row) {
  const uint8_t* codes = w.panel_codes + (p * w.num_blocks + b) * kBlock * panel_code_bytes(QType);
  const float* scales = w.panel_scales + (p * w.num_blocks + b) * num_scales(QType) * kPanelWidth;
  if constexpr (QType == kQ4_1) {
    const __m512 d0 = _mm512_loadu_ps(scales), d1 = _mm512_loadu_ps(scales + 16);
    const __m512 m0 = _mm512_loadu_ps(scales + 32), m1 = _mm512_loadu_ps(scales + 48);
    const __m512i low = _mm512_set1_epi32(0x0F);
    for (int64_t k = 0; k < kBlock; ++k) {
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 16)));
      row(k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, low)), d0, m0),
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d1, m1));
    }
  } else if constexpr (QType == kQ5_K) {
    const __m512 d0 = _mm512_loadu_ps(scales), d1 = _mm512_loadu_ps(scales + 16);
    const __m512 m0 = _mm512_loadu_ps(scales + 32), m1 = _mm512_loadu_ps(scales + 48);
    for (int64_t k = 0; k < kBlock; ++k) {
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 32));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 32 + 16));
      row(k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q0)), d0, m0),
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q1)), d1, m1));
    }
  } else if constexpr (QType == kQ2_K) {  // d and m of weights 0-15, then of 16-31: [4][32]
    for (int64_t k = 0; k < kBlock; ++k) {
      const float* dm = scales + (k / 16) * 2 * kPanelWidth;
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 32));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 32 + 16));
      row(k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q0)), _mm512_loadu_ps(dm), _mm512_loadu_ps(dm + kPanelWidth)),
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q1)), _mm512_loadu_ps(dm + 16), _mm512_loadu_ps(dm + kPanelWidth + 16)));
    }
  } else if constexpr (QType == kQ8Z) {  // s, then z: [2][32]
    const __m512 s0 = _mm512_loadu_ps(scales), s1 = _mm512_loadu_ps(scales + 16);
    const __m512 z0 = _mm512_loadu_ps(scales + 32), z1 = _mm512_loadu_ps(scales + 48);
    for (int64_t k = 0; k < kBlock; ++k) {
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 32));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 32 + 16));
      row(k, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q0)), z0), s0),
          _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q1)), z1), s1));
    }
  } else if constexpr (QType == kBF16) {  // the 32 features' bf16 weights of each k: 64 bytes
    for (int64_t k = 0; k < kBlock; ++k) {
      const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k * 64)));
      const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k * 64 + 32)));
      row(k, _mm512_castsi512_ps(_mm512_slli_epi32(low, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(high, 16)));
    }
  } else if constexpr (QType == kF8) {
    const __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(scales), _mm512_set1_ps(kF8Unit));
    const __m512 s1 = _mm512_mul_ps(_mm512_loadu_ps(scales + 16), _mm512_set1_ps(kF8Unit));
    for (int64_t k = 0; k < kBlock; ++k)
      row(k, _mm512_mul_ps(Isa::f8_readings(codes + k * 32), s0), _mm512_mul_ps(Isa::f8_readings(codes + k * 32 + 16), s1));
  } else {
    for (int64_t k = 0; k < kBlock; ++k) {
      const float* d = scales + (QType == kQ6_K ? (k / 16) * kPanelWidth : 0);  // Q6_K: a scale per 16 weights
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 32));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * 32 + 16));
      row(k, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), _mm512_loadu_ps(d)),
          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), _mm512_loadu_ps(d + 16)));
    }
  }
}

// Memory a tile asks for while it multiplies, a line of each per step (none: nothing to ask for):
// the next panel's codes and scales in the panel layout.
struct Ahead {
  const char* codes = nullptr;
  int64_t code_lines = 0;
  const char* scales = nullptr;
  int64_t scale_lines = 0;

  template <int64_t QType>
  static Ahead panel(const Weights& w, int64_t p) {
    const int64_t code_bytes = w.num_blocks * kBlock * panel_code_bytes(QType);
    const int64_t scale_bytes = w.num_blocks * num_scales(QType) * kPanelWidth * 4;
    return {reinterpret_cast<const char*>(w.panel_codes + p * code_bytes), code_bytes / 64,
            reinterpret_cast<const char*>(w.panel_scales) + p * scale_bytes, scale_bytes / 64};
  }

  void fetch(int64_t step) const {
    if (step < code_lines) __builtin_prefetch(codes + 64 * step);
    if (step < scale_lines) __builtin_prefetch(scales + 64 * step);
  }
};

// f(std::integral_constant<int, rows>) for 1 <= rows <= MaxRows.
template <int MaxRows, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (MaxRows > 1) {
    if (rows < MaxRows) return with_rows<MaxRows - 1>(rows, f);
  }
  f(std::integral_constant<int, MaxRows>{});
}

// A product of M rows by panels of the panel layout (the fp32 and bf16 kernels'): each thread
// takes panels in turn, dequant(p, buffer) fills its buffer (panel_elems of Elem) with panel p,
// and tile(rows, first_row, p, buffer, ahead) multiplies it with up to MaxRows rows of x, rows an
// std::integral_constant. Tiles are of even size (32 rows at most 12: 11, 11, 10), so that none
// is left with a few rows; the first tile of a panel reads the next panel's layout into cache as
// it goes (``ahead``), so that dequantizing it does not wait on memory.
template <int64_t QType, int MaxRows, typename Elem, typename Dequant, typename Tile>
inline void by_panels(int64_t M, int64_t N, int64_t panel_elems, const Weights& w, Dequant&& dequant, Tile&& tile) {
  const int64_t num_tiles = (M + MaxRows - 1) / MaxRows, tile_rows = (M + num_tiles - 1) / num_tiles;
  at::parallel_for(0, N / kPanelWidth, 1, [&](int64_t begin, int64_t end) {
    std::vector<Elem> panel(panel_elems);
    for (int64_t p = begin; p < end; ++p) {
      dequant(p, panel.data());
      Ahead ahead = p + 1 < end ? Ahead::panel<QType>(w, p + 1) : Ahead();
      for (int64_t r = 0; r < M; r += tile_rows) {
        with_rows<MaxRows>(std::min(tile_rows, M - r), [&](auto rows) { tile(rows, r, p, panel.data(), ahead); });
        ahead = Ahead();
      }
    }
  });
}

// The panel products below take rows of x of one element type, as a traits struct says
// (gguf_ops.cpp's Fp32Panels, gguf_bf16.cpp's Bf16Panels), and sum them in fp32 lanes; the rest of
// their code is the same for either. A traits struct names:
//   X, W                      a row's element (float; bf16 as its bits, uint16_t), and the vector
//                             the panel's weights and the rows' elements meet as
//   Cell, kPerCell            the panel's element, holding kPerCell k of one feature (a panel is
//                             [K / kPerCell][32] cells)
//   Pack(Cell* out)           a panel_block row function: stores a block's weights, k by k, into
//                             the cells from out
//   load_cells(const Cell*)   a W of 16 features' cells
//   broadcast(const X*)       a row's kPerCell elements from there, in every lane of a W
//   madd(acc, W weights, W xv)  acc plus the products of weights and xv, in fp32 lanes

constexpr int kPanelTileRows = 12;  // 24 accumulators, 2 weight vectors and a broadcast: 27 of 32 registers

// Panel p (32 features) as Panels' cells, [K / kPerCell][32]: from the panel layout, exactly.
template <typename Panels, int64_t QType>
void dequant_panel(const Weights& w, int64_t p, typename Panels::Cell* panel) {
  for (int64_t b = 0; b < w.num_blocks; ++b)
    panel_block<QType>(w, p, b, typename Panels::Pack(panel + b * (kBlock / Panels::kPerCell) * kPanelWidth));
}

// out[r, 0..31] = sum over k of x[r, k] * W[k, 0..31] for R rows, by outer products: per cell
// of k, 2 loads of weights and a broadcast of each row's x feed 2 madds a row, into accumulators
// that hold the outputs themselves (each output's sum runs over k in order).
template <typename Panels, int R>
void panel_tile(const typename Panels::X* x, int64_t K, const typename Panels::Cell* panel, float* out, int64_t N, const Ahead& ahead) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K / Panels::kPerCell; ++j) {
    ahead.fetch(j);
    const typename Panels::W w0 = Panels::load_cells(panel + j * kPanelWidth), w1 = Panels::load_cells(panel + j * kPanelWidth + 16);
    for (int r = 0; r < R; ++r) {
      const typename Panels::W xv = Panels::broadcast(x + r * K + Panels::kPerCell * j);
      acc[r][0] = Panels::madd(acc[r][0], w0, xv);
      acc[r][1] = Panels::madd(acc[r][1], w1, xv);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(out + r * N, acc[r][0]);
    _mm512_storeu_ps(out + r * N + 16, acc[r][1]);
  }
}

// out [M, N] = x [M, K] times the N x K weights, by panels (by_panels) of Panels' cells.
template <typename Panels, int64_t QType>
void products_by_panels(const typename Panels::X* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N) {
  using Cell = typename Panels::Cell;
  by_panels<QType, kPanelTileRows, Cell>(
      M, N, kPanelWidth * K / Panels::kPerCell, w, [&](int64_t p, Cell* panel) { dequant_panel<Panels, QType>(w, p, panel); },
      [&](auto rows, int64_t r, int64_t p, const Cell* panel, const Ahead& ahead) {
        panel_tile<Panels, decltype(rows)::value>(x + r * K, K, panel, out + r * N + p * kPanelWidth, N, ahead);
      });
}
}  // namespace duet_gguf
#endif
