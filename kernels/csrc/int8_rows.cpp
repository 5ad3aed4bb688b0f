// W8A8's product in one call (kernels/int8.py): the rows of x quantized per token to int8 codes
// exactly as duet.models.packed.per_token_codes does in torch (the scale is the row's largest
// magnitude over 127.5, or the dtype's eps where that is 0; a code is x / scale clamped to
// -128..127 and rounded half to even; in bf16 each of those steps rounds to bf16, as torch's
// bf16 ops do), their int32 sums with the weight's codes by at::_int_mm (oneDNN: AMX-INT8 or
// VNNI), then float(sum) * row scale * channel scale, rounded once to x's dtype: one pass over
// the rows and one over the outputs, where the torch composition's dozen calls cost as much as
// the product itself at a decode step's rows.
//
// Built in the GGUF extension, without -ffast-math: the division must stay a division.

#include <torch/types.h>  // not torch/extension.h: only the binding files include that (compile time)

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace duet_gguf {
namespace {

inline float as_dtype(float v, float) { return v; }
inline float as_dtype(float v, c10::BFloat16) { return static_cast<float>(c10::BFloat16(v)); }

// codes[0..K) and the row's scale (a value of T, held as float) of one row of x.
template <typename T>
float quantize_row(const T* x, int64_t K, int8_t* codes) {
  float largest = 0.0f;
  for (int64_t k = 0; k < K; ++k) largest = std::max(largest, std::fabs(static_cast<float>(x[k])));
  float scale = as_dtype(largest / 127.5f, T{});
  if (scale == 0.0f) scale = static_cast<float>(std::numeric_limits<T>::epsilon());
  for (int64_t k = 0; k < K; ++k) {
    const float q = std::min(std::max(as_dtype(static_cast<float>(x[k]) / scale, T{}), -128.0f), 127.0f);
    codes[k] = static_cast<int8_t>(std::nearbyint(q));
  }
  return scale;
}

template <typename T>
torch::Tensor int8_linear_as(const torch::Tensor& x, const torch::Tensor& weight_codes, const torch::Tensor& weight_scales) {
  const int64_t rows = x.size(0), features = x.size(1), outputs = weight_codes.size(0);
  auto codes = torch::empty({rows, features}, x.options().dtype(torch::kChar));
  std::vector<float> row_scales(rows);
  const T* xs = x.data_ptr<T>();
  int8_t* cs = codes.data_ptr<int8_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_scales[r] = quantize_row(xs + r * features, features, cs + r * features);
  });
  const auto sums = at::_int_mm(codes, weight_codes.t()).contiguous();
  auto out = torch::empty({rows, outputs}, x.options());
  const int32_t* ss = sums.data_ptr<int32_t>();
  const float* ws = weight_scales.data_ptr<float>();
  T* os = out.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t n = 0; n < outputs; ++n) {
        os[r * outputs + n] = static_cast<T>(static_cast<float>(ss[r * outputs + n]) * row_scales[r] * ws[n]);
      }
    }
  });
  return out;
}

}  // namespace

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor weight_codes, torch::Tensor weight_scales) {
  TORCH_CHECK(x.dim() == 2 && weight_codes.dim() == 2 && x.size(1) == weight_codes.size(1), "int8_linear: x [M, K] and codes [N, K]");
  TORCH_CHECK(weight_codes.scalar_type() == torch::kChar && weight_scales.scalar_type() == torch::kFloat, "int8_linear: int8 codes, fp32 scales");
  TORCH_CHECK(weight_codes.is_contiguous() && weight_scales.is_contiguous() && weight_scales.numel() == weight_codes.size(0),
              "int8_linear: contiguous codes and a scale per output");
  const auto rows = x.contiguous();
  if (rows.scalar_type() == torch::kBFloat16) return int8_linear_as<c10::BFloat16>(rows, weight_codes, weight_scales);
  TORCH_CHECK(rows.scalar_type() == torch::kFloat, "int8_linear: fp32 or bf16 rows");
  return int8_linear_as<float>(rows, weight_codes, weight_scales);
}

}  // namespace duet_gguf
