// bf16 products from GGUF blocks, for bf16 models on CPUs with AVX512_BF16. Each block of 32
// weights is dequantized exactly (as for fp32) and rounded to bf16 by vcvtne2ps2bf16, to nearest
// even, as torch rounds the fp32 weights into a bf16 model: the very weights the model holds
// (dequantized GGUF weights are never fp32 denormals, which the instruction would flush). Rows
// of bf16 activations meet them in vdpbf16ps, pairs of exact products added into fp32 lanes. A
// decode step then reads the codes (0.75 byte a weight for Q4_1) instead of the bf16 weights (2).
//
// Rows go by tiles of up to 8, each block dequantized in registers once per tile: a bf16 model
// sends few rows here (``GGUF_BF16_MAX_ROWS`` in ``duet/models/linear.py``), since from about 7
// rows oneDNN's packed bf16 weights (AMX) are faster, and vdpbf16ps runs at half the rate of
// the FMA ports on this Xeon.

#include "gguf_blocks.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)

namespace duet_gguf {
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
  for (int64_t b = 0; b < w.num_blocks; ++b) {
    __m512bh weights[C];
    for (int c = 0; c < C; ++c) weights[c] = bf16_block<QType>(w, n + c, b);
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

}  // namespace
}  // namespace duet_gguf

// x [M, K] bf16 -> [M, N] fp32 (the caller rounds it to bf16, as a bf16 matmul's output is).
torch::Tensor gguf_matmul_bf16(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, int64_t qtype) {
  using namespace duet_gguf;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2, "gguf_matmul_bf16 takes bf16 rows [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  const Weights w = checked(codes, scales, qtype, K);
  x = x.contiguous();
  auto out = torch::empty({M, N}, x.options().dtype(torch::kFloat32));
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  if (qtype == kQ4_1) matmul<kQ4_1>(xs, M, K, w, out.data_ptr<float>(), N);
  else if (qtype == kQ6_K) matmul<kQ6_K>(xs, M, K, w, out.data_ptr<float>(), N);
  else matmul<kQ8_0>(xs, M, K, w, out.data_ptr<float>(), N);
  return out;
}

bool has_bf16() { return true; }

#else

torch::Tensor gguf_matmul_bf16(torch::Tensor, torch::Tensor, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "gguf_matmul_bf16 needs a CPU with AVX512_BF16 (has_bf16() is false here)");
}

bool has_bf16() { return false; }

#endif
