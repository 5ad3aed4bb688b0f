// Matmuls over llama.cpp's quantized weights: the GGUF file's 4- and 8-bit codes as they are,
// and their scales beside them (``kernels/gguf.py`` splits each block into its codes and its
// fp16 scale and min, widened to fp32 once, exactly, so that no step converts them again).
//
// Each block of 32 weights is dequantized in registers and multiplied in fp32, so the weights
// a product uses are bit for bit those of gguf's own dequantizer: d * q is exact in fp32 (an
// fp16 scale times a 4- or 8-bit integer), and Q4_1's "+ m" rounds once, as gguf's does (an
// fma rounds d * q + m once too, and d * q has nothing to round). Only the bytes read shrink:
// 0.75 byte a weight for Q4_1 and 1.125 for Q8_0, against 4 for fp32. (K-quants arrive rewritten
// into these blocks: Q4_K as Q4_1, Q5_K as a byte a code with Q4_1's d and m, Q6_K as int8
// codes with a scale per 16.) A decode step of a few rows reads every weight once and computes
// little with it: its speed is the speed of reading the weights, which is what this buys.
//
// Built apart from cpu_ops.cpp, without -ffast-math: nothing may reassociate the dequantization.
// The widest vectors this CPU has are chosen at build time (-march=native on this machine):
// AVX-512, else AVX2 with FMA, else plain C++.

#include "gguf_panels.h"

#include <torch/extension.h>

#include <atomic>
#include <optional>

namespace duet_gguf {

// out[r, n] = sum_k x[r, k] * W[n, k] for R rows of x and C output features at a time, every
// block dequantized once for all R rows. R * C * kVecs accumulators stay in registers.
template <int64_t QType, int R, int C>
void tile(const float* x, int64_t K, const Weights& w, int64_t n, float* out, int64_t N) {
  Isa::V acc[R][C][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < kVecs; ++v) acc[r][c][v] = Isa::zero();
  int64_t ahead[C];
  rows_ahead<C>(n, N, ahead);
  for (int64_t b = 0; b < w.num_blocks; ++b) {
    Isa::V weights[C][kVecs];
    for (int c = 0; c < C; ++c) dequant<QType>(w, n + c, b, weights[c]);
    prefetch_ahead<QType, C>(w, ahead, b);
    for (int r = 0; r < R; ++r) {
      const float* xs = x + r * K + b * kBlock;
      for (int v = 0; v < kVecs; ++v) {
        const Isa::V xv = Isa::load(xs + v * Isa::kLanes);
        for (int c = 0; c < C; ++c) acc[r][c][v] = Isa::fmadd(weights[c][v], xv, acc[r][c][v]);
      }
    }
  }
  Isa::V totals[R * C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      totals[r * C + c] = acc[r][c][0];
      for (int v = 1; v < kVecs; ++v) totals[r * C + c] = totals[r * C + c] + acc[r][c][v];
    }
  lane_sums<R * C>(totals, [&](int i, float sum) { out[(i / C) * N + n + i % C] = sum; });
}

// Many rows (a large decode batch): dequantizing each block once per 8 rows, as above, costs
// more than the arithmetic it feeds. So a thread dequantizes a panel of kPanel output features
// once, into a buffer that stays in cache, and multiplies every row of x with it.
//
// With AVX-512 the panel is 32 features in k-major order ([K][32]), dequantized from a copy of
// the codes laid out for it (``gguf_panel_layout``: the 32 features' codes of each k side by
// side, and their scales), and tiles of up to kPanelTileRows rows multiply it by outer
// products: per k, 2 loads of weights and a broadcast of each row's x feed 2 fused
// multiply-adds a row, into accumulators that hold the outputs themselves (each output's sum
// runs over k in order; nothing is summed across lanes). Without that copy, products go by
// tiles of rows: transposing the rows' blocks into a panel in registers cost about as much as
// the multiplications at 32 rows. Elsewhere (AVX2, plain C++) the panel is 16 features' rows of
// fp32 dequantized from the codes themselves, and tiles of kTileRows x kTileColumns take dot
// products: per vector of k, kTileRows + kTileColumns loads feed kTileRows * kTileColumns
// fused multiply-adds, each accumulator summed across its lanes once.
#if defined(__AVX512F__)
constexpr int kPanel = kPanelWidth;  // tiles of up to kPanelTileRows (gguf_panels.h) multiply it
#else
constexpr int kPanel = 16;
constexpr int kTileRows = 2, kTileColumns = 4;  // 8 accumulators of 16 registers
#endif
// Rows from which panels beat tiles of rows depend on the CPU, so the loader measures them once
// per process and sets the rule (``kernels/cpu_ops.py``); these are the rows until it does.
// SmolLM2's 121 products, by tiles against by panels: on two AVX-512 cores of a Xeon (row-major
// panels then), 15.8 against 16.1 ms at 12 rows, 21.0 against 19.7 at 16; built for AVX2 on a
// Zen 4, 25.3 against 23.5 at 8, 51.0 against 37.9 at 16; on an AMD EPYC with AVX-512 and the
// panel layout, 12.5 against 13.2 at 12, 16.5 against 15.0 at 16, 32.1 against 24.5 at 32 (where
// the row-major panels had taken 36.9).
#if defined(__AVX512F__)
constexpr int64_t kPanelMinRows = 13;
#else
constexpr int64_t kPanelMinRows = 8;
#endif
std::atomic<int64_t> panel_rows{kPanelMinRows};

// A product's panel_min_rows: the one given, or (-1) this process's rule.
inline int64_t panel_min_rows_or_rule(int64_t panel_min_rows) { return panel_min_rows >= 0 ? panel_min_rows : panel_rows.load(); }

#if defined(__AVX512F__)
// Rows of fp32, for the panel products of gguf_panels.h: panels of fp32 cells, one k of a
// feature each (panel[k * 32 + c] = W[32 p + c, k]), multiplied by fused multiply-adds.
struct Fp32Panels {
  using X = float;
  using W = __m512;
  using Cell = float;
  static constexpr int64_t kPerCell = 1;
  struct Pack {
    explicit Pack(float* out) : out(out) {}
    void operator()(int64_t k, __m512 low, __m512 high) const {
      _mm512_storeu_ps(out + k * kPanelWidth, low);
      _mm512_storeu_ps(out + k * kPanelWidth + 16, high);
    }
    float* out;
  };
  static W load_cells(const Cell* p) { return _mm512_loadu_ps(p); }
  static W broadcast(const X* p) { return _mm512_set1_ps(*p); }
  static __m512 madd(__m512 acc, W weights, W xv) { return _mm512_fmadd_ps(xv, weights, acc); }
};

template <int64_t QType>
void matmul_panels(const float* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N) {
  products_by_panels<Fp32Panels, QType>(x, M, K, w, out, N);
}
#else
template <int64_t QType>
void dequant_panel(const Weights& w, int64_t n0, int64_t K, float* panel) {
  for (int c = 0; c < kPanel; ++c)
    for (int64_t b = 0; b < w.num_blocks; ++b) {
      Isa::V v[kVecs];
      dequant<QType>(w, n0 + c, b, v);
      for (int i = 0; i < kVecs; ++i) Isa::store(panel + c * K + b * kBlock + i * Isa::kLanes, v[i]);
    }
}

template <int R>
void panel_tile(const float* x, int64_t K, const float* weights, float* out, int64_t N) {
  Isa::V acc[R][kTileColumns];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kTileColumns; ++c) acc[r][c] = Isa::zero();
  for (int64_t k = 0; k < K; k += Isa::kLanes) {
    Isa::V wv[kTileColumns];
    for (int c = 0; c < kTileColumns; ++c) wv[c] = Isa::load(weights + c * K + k);
    for (int r = 0; r < R; ++r) {
      const Isa::V xv = Isa::load(x + r * K + k);
      for (int c = 0; c < kTileColumns; ++c) acc[r][c] = Isa::fmadd(xv, wv[c], acc[r][c]);
    }
  }
  lane_sums<R * kTileColumns>(&acc[0][0], [&](int i, float sum) { out[(i / kTileColumns) * N + i % kTileColumns] = sum; });
}

template <int R>
void panel_tile_upto(const float* x, int64_t rows, int64_t K, const float* weights, float* out, int64_t N) {
  if constexpr (R > 1) {
    if (rows < R) return panel_tile_upto<R - 1>(x, rows, K, weights, out, N);
  }
  panel_tile<R>(x, K, weights, out, N);
}

template <int64_t QType>
void matmul_panels(const float* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N) {
  at::parallel_for(0, N / kPanel, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(kPanel * K);
    for (int64_t p = begin; p < end; ++p) {
      dequant_panel<QType>(w, p * kPanel, K, panel.data());
      for (int64_t r = 0; r < M; r += kTileRows)
        for (int c = 0; c < kPanel; c += kTileColumns)
          panel_tile_upto<kTileRows>(x + r * K, std::min<int64_t>(kTileRows, M - r), K, panel.data() + c * K,
                                     out + r * N + p * kPanel + c, N);
    }
  });
}

#endif

template <int64_t QType>
void matmul(const float* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N, bool panels) {
  if (panels) matmul_panels<QType>(x, M, K, w, out, N);
  else by_row_tiles(M, N, [&](auto rows, auto columns, int64_t first_row, int64_t n) {
    tile<QType, decltype(rows)::value, decltype(columns)::value>(x + first_row * K, K, w, n, out + first_row * N, N);
  });
}

void matmul(int64_t qtype, const float* x, int64_t M, int64_t K, const Weights& w, float* out, int64_t N, bool panels) {
  with_qtype(qtype, [&](auto type) { matmul<decltype(type)::value>(x, M, K, w, out, N, panels); });
}


// The panel layout of N x K weights (N a multiple of 32), for AVX-512's panels: per panel of 32
// features and block, the codes k by k (Q4_1: 16 bytes a k, byte j holding feature j's code in
// its low nibble and feature 16 + j's in its high one; Q8_0, Q5_K and Q6_K: 32 bytes a k, one a
// feature; BF16: 64 bytes a k, two a feature), then the 32 features' scales side by side
// ([num_scales][32]: Q4_1's and Q5_K's d then m, Q6_K's two halves; BF16 has none). The same
// codes and scales, rearranged: a product from them is the same weights'.
std::vector<torch::Tensor> gguf_panel_layout(torch::Tensor codes, torch::Tensor scales, int64_t qtype, int64_t in_features) {
  constexpr int64_t kWidth = kPanelWidth;
  const Weights w = checked(codes, scales, qtype, in_features);
  const int64_t N = codes.size(0), S = num_scales(qtype), bytes = panel_code_bytes(qtype);
  TORCH_CHECK(N % kWidth == 0, "the panel layout takes a multiple of ", kWidth, " output features, not ", N);
  auto panel_codes = torch::zeros({N / kWidth, w.num_blocks, kBlock, bytes}, torch::kUInt8);
  auto panel_scales = torch::empty({N / kWidth, w.num_blocks, S, kWidth}, torch::kFloat32);
  uint8_t* pc = panel_codes.data_ptr<uint8_t>();
  float* ps = panel_scales.data_ptr<float>();
  at::parallel_for(0, N / kWidth, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t b = 0; b < w.num_blocks; ++b) {
        uint8_t* to_codes = pc + (p * w.num_blocks + b) * kBlock * bytes;
        float* to_scales = ps + (p * w.num_blocks + b) * S * kWidth;
        for (int64_t c = 0; c < kWidth; ++c) {
          const int64_t n = p * kWidth + c;
          const uint8_t* from = w.codes + (n * w.num_blocks + b) * code_bytes(qtype);
          for (int64_t s = 0; s < S; ++s) to_scales[s * kWidth + c] = w.scales[(n * w.num_blocks + b) * S + s];
          if (qtype == kQ4_1) {  // weight j's code: bits 16 (j / 16) + 4 ((j % 16) / 4) of word j % 4 (gguf_blocks.h)
            uint32_t words[4];
            std::memcpy(words, from, 16);
            for (int64_t j = 0; j < kBlock; ++j) {
              const uint8_t code = (words[j % 4] >> (16 * (j / 16) + 4 * ((j % 16) / 4))) & 0x0F;
              to_codes[j * bytes + c % 16] |= c < 16 ? code : code << 4;
            }
          } else if (qtype == kBF16) {  // two bytes a weight
            for (int64_t j = 0; j < kBlock; ++j) std::memcpy(to_codes + j * bytes + 2 * c, from + 2 * bf16_half(j), 2);
          } else {
            for (int64_t j = 0; j < kBlock; ++j) to_codes[j * bytes + c] = from[j];
          }
        }
      }
  });
  return {panel_codes, panel_scales};
}

// Whether this build's panels read the panel layout (AVX-512's do; the others the codes).
bool panels_need_layout() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// Whether M rows of a product over w go by panels, under the rule given (-1: the process's).
bool by_panels(const Weights& w, int64_t M, int64_t N, int64_t panel_min_rows) {
  if (M < panel_min_rows_or_rule(panel_min_rows)) return false;
  return panels_need_layout() ? w.panel_codes != nullptr : N % kPanel == 0;
}

// x [M, K] fp32 -> [M, N] fp32 against the N x K weights of type qtype; by panels from
// panel_min_rows rows (-1: the process's rule) where the weights can go by panels (AVX-512: with
// their panel layout; otherwise N a whole number of panels), by tiles of rows below (tests and
// the loader's measurement force either way).
torch::Tensor gguf_matmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype, int64_t panel_min_rows = -1,
                          std::optional<torch::Tensor> panel_codes = std::nullopt,
                          std::optional<torch::Tensor> panel_scales = std::nullopt) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "gguf_matmul takes fp32 rows [M, K]");
  const int64_t K = x.size(1), N = codes.size(0);
  const Weights w = with_layout(checked(codes, scales, qtype, K), qtype, N, panel_codes, panel_scales);
  x = x.contiguous();
  auto out = torch::empty({x.size(0), N}, x.options());
  matmul(qtype, x.data_ptr<float>(), x.size(0), K, w, out.data_ptr<float>(), N, by_panels(w, x.size(0), N, panel_min_rows));
  return out;
}

// The weights as the matmul sees them, [N, in_features] fp32: what the loader and the tests
// compare with the float weights gguf's dequantizer made.
torch::Tensor gguf_dequantize(torch::Tensor codes, torch::Tensor scales, int64_t qtype, int64_t in_features) {
  const Weights w = checked(codes, scales, qtype, in_features);
  const int64_t N = codes.size(0);
  auto out = torch::empty({N, in_features}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    Isa::V v[kVecs];
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < w.num_blocks; ++b) {
        with_qtype(qtype, [&](auto type) { dequant<decltype(type)::value>(w, n, b, v); });
        for (int i = 0; i < kVecs; ++i) Isa::store(o + n * in_features + b * kBlock + i * Isa::kLanes, v[i]);
      }
  });
  return out;
}

std::string isa() { return Isa::kName; }

void set_panel_min_rows(int64_t rows) {
  TORCH_CHECK(rows >= 1, "panel_min_rows must be at least 1, got ", rows);
  panel_rows.store(rows);
}

int64_t panel_min_rows() { return panel_rows.load(); }

}  // namespace duet_gguf

// gguf_bf16.cpp's, where this CPU has AVX512_BF16.
torch::Tensor gguf_matmul_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype, int64_t panel_min_rows,
                               std::optional<torch::Tensor> panel_codes, std::optional<torch::Tensor> panel_scales);
torch::Tensor gguf_matmul_bf16_rounded(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype,
                                       int64_t panel_min_rows, std::optional<torch::Tensor> panel_codes,
                                       std::optional<torch::Tensor> panel_scales);
bool has_bf16();
void set_bf16_panel_min_rows(int64_t rows);
int64_t bf16_panel_min_rows();
bool has_amx();
void set_bf16_amx_min_rows(int64_t rows);
int64_t bf16_amx_min_rows();
namespace duet_gguf {
// gguf_argmax.cpp's.
torch::Tensor gguf_matmul_argmax(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype, torch::Tensor excluded,
                                 int64_t panel_min_rows, std::optional<torch::Tensor> panel_codes,
                                 std::optional<torch::Tensor> panel_scales);
// batch_invariant.cpp's.
int64_t invariant_panel_width();
torch::Tensor invariant_linear(torch::Tensor x, torch::Tensor panels, int64_t out_features);
// int8_rows.cpp's.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor weight_scales, torch::Tensor unit_scales,
                          torch::Tensor zero_points);
torch::Tensor float8_rows(torch::Tensor x, std::optional<torch::Tensor> scale);
}  // namespace duet_gguf

// The products as torch operators too, for C++ in another extension (cpu_ops' decoder stack) to
// call through the dispatcher, with no Python between.
TORCH_LIBRARY(duet_gguf, m) {
  m.def("matmul", [](torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype, int64_t panel_min_rows,
                     std::optional<torch::Tensor> panel_codes, std::optional<torch::Tensor> panel_scales) {
    return duet_gguf::gguf_matmul(x, codes, scales, qtype, panel_min_rows, panel_codes, panel_scales);
  });
  m.def("matmul_bf16", [](torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype, int64_t panel_min_rows,
                          std::optional<torch::Tensor> panel_codes, std::optional<torch::Tensor> panel_scales) {
    return gguf_matmul_bf16_rounded(x, codes, scales, qtype, panel_min_rows, panel_codes, panel_scales);  // bf16 out
  });
  m.def("dequantize", &duet_gguf::gguf_dequantize);
  m.def("invariant_linear", &duet_gguf::invariant_linear);
  m.def("int8_linear", &duet_gguf::int8_linear);
  m.def("float8_rows", &duet_gguf::float8_rows);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace duet_gguf;
  m.def("gguf_matmul", &gguf_matmul, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("qtype"),
        py::arg("panel_min_rows") = -1, py::arg("panel_codes") = py::none(), py::arg("panel_scales") = py::none());
  m.def("gguf_matmul_argmax", &gguf_matmul_argmax, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("qtype"),
        py::arg("excluded"), py::arg("panel_min_rows") = -1, py::arg("panel_codes") = py::none(),
        py::arg("panel_scales") = py::none());
  m.def("gguf_panel_layout", &gguf_panel_layout);
  m.def("panels_need_layout", &panels_need_layout);
  m.def("gguf_dequantize", &gguf_dequantize);
  m.def("gguf_matmul_bf16", &gguf_matmul_bf16, py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("qtype"),
        py::arg("panel_min_rows") = -1, py::arg("panel_codes") = py::none(), py::arg("panel_scales") = py::none());
  m.def("set_bf16_panel_min_rows", &set_bf16_panel_min_rows, "bf16 products of at least this many rows go by panels, in this process");
  m.def("bf16_panel_min_rows", &bf16_panel_min_rows);
  m.def("has_amx", &has_amx, "whether bf16 panels can go by AMX tiles here (the CPU, this build, and the kernel's permission)");
  m.def("set_bf16_amx_min_rows", &set_bf16_amx_min_rows, "bf16 products of at least this many rows go by AMX tiles (the process's rule)");
  m.def("bf16_amx_min_rows", &bf16_amx_min_rows);
  m.def("has_bf16", &has_bf16);
  m.def("isa", &isa);
  m.def("invariant_linear", &invariant_linear, "x [M, K] times weights in panels: every output summed over k in one order");
  m.def("invariant_panel_width", &invariant_panel_width);
  m.def("int8_linear", &int8_linear, "W8A8: x's rows quantized per token, their int8 sums with the codes, scaled per row and channel");
  m.def("float8_rows", &float8_rows, py::arg("x"), py::arg("scale") = py::none(),
        "FP8 W8A8's inputs: x's rows quantized to float8 and back, times their scales (per token, or the static scale given)");
  m.def("set_panel_min_rows", &set_panel_min_rows, "Products of at least this many rows go by panels, in this process");
  m.def("panel_min_rows", &panel_min_rows);
}
