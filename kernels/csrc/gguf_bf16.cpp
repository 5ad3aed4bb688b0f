// bf16 products from GGUF blocks, for bf16 models on CPUs with AVX512_BF16. Each block of 32
// weights is dequantized exactly (as for fp32) and rounded to bf16 by vcvtne2ps2bf16, to nearest
// even, as torch rounds the fp32 weights into a bf16 model: the very weights the model holds
// (dequantized GGUF weights are never fp32 denormals, which the instruction would flush). Rows
// of bf16 activations meet them in vdpbf16ps, pairs of exact products added into fp32 lanes. A
// decode step then reads the codes (0.75 byte a weight for Q4_1) instead of the bf16 weights (2).
//
// Rows go by tiles of up to 8, each block dequantized in registers once per tile, or (from the
// rows this process measured faster, ``set_bf16_panel_min_rows``, with the weights' panel
// layout) by panels as the fp32 ones on AVX-512 (gguf_panels.h's panel products, written once for
// both and given the rows' type by Bf16Panels below): a panel of 32 features is dequantized once
// into bf16 pairs (for each pair of k, a vector per 16 features whose 32-bit lanes hold a
// feature's weights at k and k + 1, rounded as above), which tiles of up to 12 rows multiply by
// vdpbf16ps against a broadcast pair of each row's x. How many rows the blocks serve before
// oneDNN's packed bf16 weights is measured too (``duet/models/linear.py``): on a Xeon with AMX,
// about 6; vdpbf16ps runs at half the rate of the FMA ports there.
//
// On CPUs with AMX-BF16, a panel's bf16 pairs are already the tiles' layout (16 rows of k pairs,
// 64 bytes of 16 features' pairs each): tdpbf16ps multiplies two tiles of up to 16 rows of x by
// a panel's two halves, 32 k a step, instead of a vdpbf16ps per row and pair (``amx_panel_rows``).
// From how many rows it does, rather than by vdpbf16ps tiles or panels, is measured once per
// process (``set_bf16_amx_min_rows``), and it serves only the process's rule: a product whose
// rows are given a rule of their own (``panel_min_rows`` >= 0, ``batch_invariant``'s) keeps
// vdpbf16ps, whose sums run in one order whatever the rows.

#include "gguf_panels.h"

#include <atomic>
#include <optional>

#include "amx.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)

namespace duet_gguf {
void round_to_bf16(float* values, int64_t n);  // gguf_argmax.cpp's: as .to(torch.bfloat16) rounds

namespace {

inline __m512bh load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// One block of 32 weights as 32 bf16: the dequantized floats rounded as torch rounds them.
template <int64_t QType>
inline __m512bh bf16_block(const Weights& w, int64_t n, int64_t b) {
  Isa::V v[kVecs];
  dequant<QType>(w, n, b, v);
  return _mm512_cvtne2ps_pbh(v[1], v[0]);  // weights 0-15 from v[0], 16-31 from v[1]
}

template <int64_t QType, int R, int C>
void tile(const uint16_t* x, int64_t K, const Weights& w, int64_t n, float* out, int64_t N) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t ahead[C];
  rows_ahead<C>(n, N, ahead);
  for (int64_t b = 0; b < w.num_blocks; ++b) {
    __m512bh weights[C];
    for (int c = 0; c < C; ++c) weights[c] = bf16_block<QType>(w, n + c, b);
    prefetch_ahead<QType, C>(w, ahead, b);  // (one row took 1.36x as long from cold weights without it)
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = load_bf16(x + r * K + b * kBlock);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], weights[c], xv);
    }
  }
  lane_sums<R * C>(&acc[0][0], [&](int i, float sum) { out[(i / C) * N + n + i % C] = sum; });
}

template <int64_t QType>
void matmul(const uint16_t* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N) {
  by_row_tiles(M, N, [&](auto rows, auto columns, int64_t first_row, int64_t n) {
    tile<QType, decltype(rows)::value, decltype(columns)::value>(x + first_row * K, K, w, n, out + first_row * N, N);
  });
}

// A feature's weights at k and k + 1 in one 32-bit lane (k's in the low half), for 16 features:
// both rounded by one vcvtne2ps2bf16 (words 0-15 from even, 16-31 from odd), then word i of
// each half brought side by side by one vpermw (a third of the instructions of rounding each
// vector apart and widening it, where dequantizing a panel took a third of a batch-32 step's
// products).
inline __m512i bf16_pairs(__m512 even, __m512 odd) {
  const __m512i side_by_side = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(side_by_side, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// Rows of bf16, for the panel products of gguf_panels.h: panels of bf16 pairs, a feature's
// weights at k and k + 1 in a cell (panel[(k / 2) * 32 + c], k even), rounded as bf16_block's;
// a broadcast pair of each row's x meets them in vdpbf16ps.
struct Bf16Panels {
  using X = uint16_t;  // bf16's bits
  using W = __m512bh;
  using Cell = uint32_t;
  static constexpr int64_t kPerCell = 2;
  struct Pack {
    explicit Pack(uint32_t* out) : out(out) {}
    void operator()(int64_t k, __m512 low, __m512 high) {
      if (k % 2 == 0) {
        even_low = low;
        even_high = high;
        return;
      }
      _mm512_storeu_si512(out + (k / 2) * kPanelWidth, bf16_pairs(even_low, low));
      _mm512_storeu_si512(out + (k / 2) * kPanelWidth + 16, bf16_pairs(even_high, high));
    }
    uint32_t* out;
    __m512 even_low, even_high;
  };
  static W load_cells(const Cell* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static W broadcast(const X* p) { return (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(p)); }
  static __m512 madd(__m512 acc, W weights, W xv) { return _mm512_dpbf16_ps(acc, weights, xv); }
};

#ifdef DUET_AMX
bool amx_permitted() { return duet_amx::permitted(); }

// The tiles of one shape of rows: tile 0 holds up to 16 rows of 32 k of x and tile 1 the next
// up to 16 (none where ``rows`` <= 16), tiles 2 and 3 a panel's 16 pairs of k for features 0-15
// and 16-31 (a panel row of pairs is 32 cells apart), tiles 4 and 5 tile 0's sums, 6 and 7 tile
// 1's. A thread's AmxChunk configures its tiles for the first shape of rows it meets and again
// only when the shape changes (it was loaded for every panel), and releases them when the
// thread's panels are done (tiles left in use are saved with the thread's state, 8 KB, at every
// context switch).
struct AmxChunk {
  int64_t rows = -1;  // the shape configured, none yet

  void configure(int64_t m) {
    if (m == rows) return;
    rows = m;
    const uint8_t first = static_cast<uint8_t>(std::min<int64_t>(m, 16)), second = static_cast<uint8_t>(m - first);
    duet_amx::TileConfig config;
    config.rows[0] = config.rows[4] = config.rows[5] = first;
    config.rows[1] = config.rows[6] = config.rows[7] = second;
    config.rows[2] = config.rows[3] = 16;
    for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = config.rows[t] ? 64 : 0;
    config.load();
  }

  ~AmxChunk() {
    if (rows >= 0) _tile_release();
  }
};

// out[r, 0..31] = x[r, :] times panel features 0..31 for the configured rows (up to 32). Each
// tdpbf16ps adds, per output, a k pair's two exact products into its fp32 sum, k in order: the
// same sums whether a row goes in tile 0 or 1. A panel's tiles are loaded once for both row
// tiles, and the four sums are independent of each other. ``between(j)`` runs at each step j
// of 32 k, while the tiles compute (the next panel's block j is dequantized there).
template <bool Two, typename Between>
void amx_panel_rows(const uint16_t* x, int64_t K, const uint32_t* panel, float* out, int64_t N, Between&& between) {
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (Two) {
    _tile_zero(6);
    _tile_zero(7);
  }
  constexpr int64_t kPairRows = kBlock / 2;  // a tile of B: 16 rows of k pairs
  for (int64_t j = 0; j < K / kBlock; ++j) {
    _tile_loadd(2, panel + j * kPairRows * kPanelWidth, kPanelWidth * sizeof(uint32_t));
    _tile_loadd(3, panel + j * kPairRows * kPanelWidth + 16, kPanelWidth * sizeof(uint32_t));
    _tile_loadd(0, x + j * kBlock, K * sizeof(uint16_t));
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if constexpr (Two) {
      _tile_loadd(1, x + 16 * K + j * kBlock, K * sizeof(uint16_t));
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
    between(j);
  }
  _tile_stored(4, out, N * sizeof(float));
  _tile_stored(5, out + 16, N * sizeof(float));
  if constexpr (Two) {
    _tile_stored(6, out + 16 * N, N * sizeof(float));
    _tile_stored(7, out + 16 * N + 16, N * sizeof(float));
  }
}

constexpr int64_t kAmxTileRows = 32;  // two tiles of rows a panel

// by_panels' plan (gguf_panels.h) with two panel buffers: while the tiles multiply panel p's
// first rows, its next panel is dequantized block by block into the other buffer (vector
// instructions beside the tiles' own unit, where the two in turn took about as long each), and
// the one after it is read into cache.
template <int64_t QType>
void products_by_amx_panels(const uint16_t* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N) {
  const int64_t num_tiles = (M + kAmxTileRows - 1) / kAmxTileRows, tile_rows = (M + num_tiles - 1) / num_tiles;
  const int64_t panel_cells = kPanelWidth * K / 2;
  constexpr int64_t kPairRows = kBlock / 2;
  at::parallel_for(0, N / kPanelWidth, 1, [&](int64_t begin, int64_t end) {
    AmxChunk tiles;
    std::vector<uint32_t> buffers(2 * panel_cells);
    uint32_t* panel = buffers.data();
    uint32_t* next = panel + panel_cells;
    dequant_panel<Bf16Panels, QType>(w, begin, panel);
    for (int64_t p = begin; p < end; ++p) {
      const Ahead ahead = p + 2 < end ? Ahead::panel<QType>(w, p + 2) : Ahead();
      for (int64_t r = 0; r < M; r += tile_rows) {
        const int64_t rows = std::min(tile_rows, M - r);
        tiles.configure(rows);
        auto between = [&](int64_t j) {
          if (r != 0) return;
          for (int64_t line = 0; line < kPairRows; ++line) ahead.fetch(j * kPairRows + line);
          if (p + 1 < end) panel_block<QType>(w, p + 1, j, Bf16Panels::Pack(next + j * kPairRows * kPanelWidth));
        };
        if (rows > 16) amx_panel_rows<true>(x + r * K, K, panel, out + r * N + p * kPanelWidth, N, between);
        else amx_panel_rows<false>(x + r * K, K, panel, out + r * N + p * kPanelWidth, N, between);
      }
      std::swap(panel, next);
    }
  });
}

#else
bool amx_permitted() { return false; }
#endif

template <int64_t QType>
void matmul_any(const uint16_t* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N, int way) {
#ifdef DUET_AMX
  if (way == kBf16Amx) return products_by_amx_panels<QType>(x, M, K, w, out, N);
#endif
  if (way == kBf16Panels) products_by_panels<Bf16Panels, QType>(x, M, K, w, out, N);
  else matmul<QType>(x, M, K, w, out, N);
}

std::atomic<int64_t> bf16_panel_rows{1 << 30};  // never, until the loader measures this CPU
std::atomic<int64_t> bf16_amx_rows{1 << 30};  // never, until the loader measures this CPU

}  // namespace

int bf16_way(const Weights& w, int64_t M, int64_t panel_min_rows) {
  if (w.panel_codes == nullptr) return kBf16Tiles;
  if (panel_min_rows < 0 && M >= bf16_amx_rows.load()) return kBf16Amx;
  return M >= (panel_min_rows >= 0 ? panel_min_rows : bf16_panel_rows.load()) ? kBf16Panels : kBf16Tiles;
}

void bf16_products(const uint16_t* x, int64_t M, int64_t K, int64_t qtype, const Weights& w, float* out, int64_t N, int way) {
  with_qtype(qtype, [&](auto type) { matmul_any<decltype(type)::value>(x, M, K, w, out, N, way); });
}

}  // namespace duet_gguf

// x [M, K] bf16 -> [M, N] fp32 (the caller rounds it to bf16, as a bf16 matmul's output is); by
// panels from panel_min_rows rows (-1: the process's rule) where the weights' panel layout is
// given (as gguf_matmul takes it, and checks it), by tiles of rows otherwise.
torch::Tensor gguf_matmul_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype, int64_t panel_min_rows,
                               std::optional<torch::Tensor> panel_codes, std::optional<torch::Tensor> panel_scales) {
  using namespace duet_gguf;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2, "gguf_matmul_bf16 takes bf16 rows [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const Weights w = with_layout(checked(codes, scales, qtype, K), qtype, N, panel_codes, panel_scales);
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  bf16_products(xs, M, K, qtype, w, out.data_ptr<float>(), N, bf16_way(w, M, panel_min_rows));
  return out;
}

// The same products rounded to bf16 in the call, as .to(torch.bfloat16) rounds them (the decoder
// stack's operator): no second operator call to round them.
torch::Tensor gguf_matmul_bf16_rounded(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype,
                                       int64_t panel_min_rows, std::optional<torch::Tensor> panel_codes,
                                       std::optional<torch::Tensor> panel_scales) {
  torch::Tensor sums = gguf_matmul_bf16(x, codes, scales, qtype, panel_min_rows, panel_codes, panel_scales);
  float* values = sums.data_ptr<float>();
  const int64_t n = sums.numel();
  duet_gguf::round_to_bf16(values, n);  // the high halves are now the bf16s
  auto out = torch::empty(sums.sizes(), sums.options().dtype(torch::kBFloat16));
  auto* bits = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_loadu_si512(values + i), 16)));
  for (; i < n; ++i) {
    uint32_t word;
    std::memcpy(&word, values + i, sizeof(word));
    bits[i] = static_cast<uint16_t>(word >> 16);
  }
  return out;
}

bool has_bf16() { return true; }

bool has_amx() { return duet_gguf::amx_permitted(); }

void set_bf16_amx_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "amx_min_rows must be at least 1, got ", rows);
  TORCH_CHECK(rows >= (1 << 30) || has_amx(), "AMX tiles need a CPU with AMX-BF16 (and a build for it)");
  duet_gguf::bf16_amx_rows.store(rows);
}

int64_t bf16_amx_min_rows() { return duet_gguf::bf16_amx_rows.load(); }

void set_bf16_panel_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "panel_min_rows must be at least 1, got ", rows);
  duet_gguf::bf16_panel_rows.store(rows);
}

int64_t bf16_panel_min_rows() { return duet_gguf::bf16_panel_rows.load(); }

#else

namespace duet_gguf {
int bf16_way(const Weights&, int64_t, int64_t) { return kBf16Tiles; }
void bf16_products(const uint16_t*, int64_t, int64_t, int64_t, const Weights&, float*, int64_t, int) {
  TORCH_CHECK(false, "bf16 products from GGUF blocks need a CPU with AVX512_BF16");
}
}  // namespace duet_gguf

torch::Tensor gguf_matmul_bf16(torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, std::optional<torch::Tensor>,
                               std::optional<torch::Tensor>) {
  TORCH_CHECK(false, "gguf_matmul_bf16 needs a CPU with AVX512_BF16 (has_bf16() is false here)");
}

torch::Tensor gguf_matmul_bf16_rounded(torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, std::optional<torch::Tensor>,
                                       std::optional<torch::Tensor>) {
  TORCH_CHECK(false, "gguf_matmul_bf16 needs a CPU with AVX512_BF16 (has_bf16() is false here)");
}

bool has_bf16() { return false; }

void set_bf16_panel_min_rows(int64_t) { TORCH_CHECK(false, "bf16 panels need a CPU with AVX512_BF16"); }

int64_t bf16_panel_min_rows() { return 1 << 30; }

bool has_amx() { return false; }

void set_bf16_amx_min_rows(int64_t rows) { TORCH_CHECK(rows >= (1 << 30), "AMX tiles need a CPU with AMX-BF16"); }

int64_t bf16_amx_min_rows() { return 1 << 30; }

#endif
