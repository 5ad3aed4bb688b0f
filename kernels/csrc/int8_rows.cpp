// W8A8's product in one call (kernels/w8a8.py): the rows of x quantized per token to int8 codes
// exactly as per_token_codes does in torch (the scale is the row's largest magnitude over 127.5,
// or the dtype's eps where that is 0; a code is x / scale clamped to -128..127 and rounded half to
// even; in bf16 each of those steps rounds to bf16, as torch's bf16 ops do), their exact sums with
// the weight's packed codes by onednn::qlinear_pointwise (AMX-INT8 or VNNI; unit scales, fp32
// out), then float(sum) * row scale * channel scale, rounded once to x's dtype: one pass over the
// rows and one over the outputs, where the torch composition's dozen calls cost as much as the
// product itself at a decode step's rows.
//
// FP8 W8A8's inputs likewise (float8_rows): each row quantized per token to float8 (e4m3fn) and
// back, times its scale, as per_token_codes and dynamic_per_token do in torch (the scale is the
// row's largest magnitude over 448; a code is x / scale clamped to +-448 and rounded to e4m3 by
// c10's own conversion, torch's), in one pass where the torch composition took a dozen calls;
// or, given a static scheme's one calibrated scale, as StaticInput does (each step in the dtype
// torch's type promotion gives it: x / s in x's and s's promoted dtype, codes * s in s's, the
// result in x's).
//
// Built in the GGUF extension, without -ffast-math: the division must stay a division.

#include <torch/types.h>  // not torch/extension.h: only the binding files include that (compile time)

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
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

using Int8Sums = torch::Tensor(torch::Tensor, double, int64_t, torch::Tensor, torch::Tensor, torch::Tensor, std::optional<torch::Tensor>,
                               double, int64_t, std::optional<c10::ScalarType>, c10::string_view, c10::List<std::optional<c10::Scalar>>,
                               c10::string_view);  // as the operator is registered (qlinear.cpp)

template <typename T>
torch::Tensor int8_linear_as(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& weight_scales,
                             const torch::Tensor& unit_scales, const torch::Tensor& zero_points) {
  static const auto int8_sums =
      c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "").typed<Int8Sums>();
  const int64_t rows = x.size(0), features = x.size(1), outputs = weight_scales.size(0);
  auto codes = torch::empty({rows, features}, x.options().dtype(torch::kChar));
  std::vector<float> row_scales(rows);
  const T* xs = x.data_ptr<T>();
  int8_t* cs = codes.data_ptr<int8_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row_scales[r] = quantize_row(xs + r * features, features, cs + r * features);
  });
  const auto sums = int8_sums.call(codes, 1.0, 0, packed, unit_scales, zero_points, std::nullopt, 1.0, 0, torch::kFloat, "none",
                                   c10::List<std::optional<c10::Scalar>>(), "")
                        .contiguous();
  auto out = torch::empty({rows, outputs}, x.options());
  const float* ss = sums.data_ptr<float>();
  const float* ws = weight_scales.data_ptr<float>();
  T* os = out.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t n = 0; n < outputs; ++n) os[r * outputs + n] = static_cast<T>(ss[r * outputs + n] * row_scales[r] * ws[n]);
    }
  });
  return out;
}

constexpr float kFloat8Max = 448.0f;

// q clamped to +-448 and rounded to e4m3 by c10's own conversion (torch's), as a float; NaN stays.
inline float float8_code(float q) {
  q = std::min(std::max(q, -kFloat8Max), kFloat8Max);
  return std::isnan(q) ? q : static_cast<float>(c10::Float8_e4m3fn(q));
}

// One row of x quantized to float8 and back, times its scale, into out (a value of T each, every
// step rounded to T as torch's ops in T round). A NaN makes the row's scale NaN, as amax does.
template <typename T>
void float8_row(const T* x, int64_t K, T* out) {
  float largest = 0.0f;
  bool nan = false;
  for (int64_t k = 0; k < K; ++k) {
    const float v = static_cast<float>(x[k]);
    nan = nan || std::isnan(v);
    largest = std::max(largest, std::fabs(v));
  }
  float scale = nan ? std::numeric_limits<float>::quiet_NaN() : as_dtype(largest / kFloat8Max, T{});
  if (scale == 0.0f) scale = static_cast<float>(std::numeric_limits<T>::epsilon());
  for (int64_t k = 0; k < K; ++k) out[k] = static_cast<T>(float8_code(as_dtype(static_cast<float>(x[k]) / scale, T{})) * scale);
}

template <typename T>
torch::Tensor float8_rows_as(const torch::Tensor& x) {
  const int64_t rows = x.size(0), features = x.size(1);
  auto out = torch::empty_like(x);
  const T* xs = x.data_ptr<T>();
  T* os = out.data_ptr<T>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) float8_row(xs + r * features, features, os + r * features);
  });
  return out;
}

// v rounded to bf16 (as torch rounds an fp32 result into bf16), or kept (fp32).
inline float rounded(float v, bool bf16) { return bf16 ? static_cast<float>(c10::BFloat16(v)) : v; }

// x [M, K] (T) at one static scale s: ((clamp(x / s) to e4m3) * s), each step rounded as above.
template <typename T>
torch::Tensor float8_static_as(const torch::Tensor& x, float s, bool divide_bf16, bool scale_bf16) {
  auto out = torch::empty_like(x);
  const T* xs = x.data_ptr<T>();
  T* os = out.data_ptr<T>();
  at::parallel_for(0, x.numel(), 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      os[i] = static_cast<T>(rounded(float8_code(rounded(static_cast<float>(xs[i]) / s, divide_bf16)) * s, scale_bf16));
  });
  return out;
}

}  // namespace

torch::Tensor float8_rows(torch::Tensor x, std::optional<torch::Tensor> scale) {
  TORCH_CHECK(x.dim() == 2, "float8_rows: x [M, K]");
  const auto rows = x.contiguous();
  const bool bf16 = rows.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || rows.scalar_type() == torch::kFloat, "float8_rows: fp32 or bf16 rows");
  if (!scale.has_value()) return bf16 ? float8_rows_as<c10::BFloat16>(rows) : float8_rows_as<float>(rows);
  TORCH_CHECK(scale->numel() == 1 && scale->device().is_cpu() && (scale->scalar_type() == torch::kFloat || scale->scalar_type() == torch::kBFloat16),
              "float8_rows: one fp32 or bf16 scale on the CPU");
  const bool scale_bf16 = scale->scalar_type() == torch::kBFloat16;
  const bool divide_bf16 = at::result_type(rows, *scale) == torch::kBFloat16;
  // read in place (a step calls this for every product: no conversion, no item())
  const float s = scale_bf16 ? static_cast<float>(*scale->const_data_ptr<c10::BFloat16>()) : *scale->const_data_ptr<float>();
  return bf16 ? float8_static_as<c10::BFloat16>(rows, s, divide_bf16, scale_bf16) : float8_static_as<float>(rows, s, divide_bf16, scale_bf16);
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor weight_scales, torch::Tensor unit_scales,
                          torch::Tensor zero_points) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && x.size(1) == packed.size(0), "int8_linear: x [M, K] and codes packed [K, N]");
  TORCH_CHECK(packed.scalar_type() == torch::kChar && weight_scales.scalar_type() == torch::kFloat, "int8_linear: int8 codes, fp32 scales");
  TORCH_CHECK(weight_scales.is_contiguous() && weight_scales.numel() == packed.size(1), "int8_linear: a scale per output");
  const auto rows = x.contiguous();
  if (rows.scalar_type() == torch::kBFloat16) return int8_linear_as<c10::BFloat16>(rows, packed, weight_scales, unit_scales, zero_points);
  TORCH_CHECK(rows.scalar_type() == torch::kFloat, "int8_linear: fp32 or bf16 rows");
  return int8_linear_as<float>(rows, packed, weight_scales, unit_scales, zero_points);
}

}  // namespace duet_gguf
