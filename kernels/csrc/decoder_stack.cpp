// A Llama model's decoder layers for one step of short queries (decode, speculative
// verification), run in one call from Python: the same kernels, in the same order, on the same
// tensors as duet/models/llama.py's layer loop, so the outputs are bit for bit the loop's.
//
// What this removes is the loop's Python: ~10 module calls, splits and views a layer, 30
// layers a step (on a 2-core AMD EPYC, `duet bench step`: time outside the kernels went from
// 1.19 to 0.41 ms of a single-stream step, and from 1.86 to 1.03 ms of a batch-32 step). Each product picks its path by row count exactly as
// Linear.forward does: GGUF blocks (duet_gguf::matmul, another extension's operator, reached
// through the dispatcher), the float weight's panels (batch_invariant.cpp), oneDNN's packed
// weight, W8A8's int8 product (int8_rows.cpp), or at::linear; under batch_invariant every
// attention row takes the prompt kernel. The GIL is released for the whole stack, so a
// replica's other threads (KV transfer, the event loop) run meanwhile.

#include "cpu_ops.h"

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <pybind11/stl.h>

#include <array>
#include <chrono>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace duet_cpu {
namespace {

// One Linear's weights and the row counts each path serves (Linear.forward's rule).
struct LinearPlan {
  torch::Tensor weight;  // undefined: the blocks are the weight (quantized at load)
  torch::Tensor packed;  // oneDNN's reordered weight, or undefined
  int64_t packed_low = 0, packed_high = -1;
  torch::Tensor codes, scales;  // GGUF blocks, or undefined
  int64_t qtype = 0;
  int64_t block_rows = -1;  // rows up to which the blocks serve the product
  int64_t panel_min_rows = -1;  // rows from which the blocks go by panels (-1: the process's rule)
  std::optional<torch::Tensor> panel_codes, panel_scales;  // the blocks' panel layout, or none
  torch::Tensor invariant;  // the weight in batch_invariant.cpp's panels, or undefined
  int64_t out_features = 0;
  int64_t panel_rows = -1;  // rows up to which those panels serve the product (past the blocks'; -1: none)
  torch::Tensor input_order;  // the input features in the weight's column order (GPTQ's activation order), or undefined
  // W8A8 in integers at every row count (w8a8.py's Int8Weight), or undefined
  torch::Tensor int8_packed, int8_scales, int8_unit_scales, int8_zero_points;
  // FP8 W8A8: each input quantized to float8 first (duet_gguf::float8_rows), per token or at
  // float8_scale (a static scheme's; undefined: per token)
  bool float8_inputs = false;
  torch::Tensor float8_scale;
};

struct LayerPlan {
  torch::Tensor input_norm, post_norm;
  LinearPlan qkv, o, gate_up, down;
  int64_t window;  // its sliding window (0: none), as paged_attention takes it
  bool rotates;    // false: a NoPE layer (its queries and keys go unrotated)
};

using BlockProduct = torch::Tensor(torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t, std::optional<torch::Tensor>,
                                   std::optional<torch::Tensor>);
using Dequantize = torch::Tensor(torch::Tensor, torch::Tensor, int64_t, int64_t);
using InvariantProduct = torch::Tensor(torch::Tensor, torch::Tensor, int64_t);
using Int8Product = torch::Tensor(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor);
using Float8Rows = torch::Tensor(torch::Tensor, std::optional<torch::Tensor>);
using PackedProduct = torch::Tensor(const torch::Tensor&, const torch::Tensor&, const std::optional<torch::Tensor>&,
                                    c10::string_view, c10::List<std::optional<c10::Scalar>>, std::optional<c10::string_view>);

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

enum Part { kProducts, kAttention, kRopeKV, kNorms, kActivation, kLoRA, kNumParts };
const char* const kPartNames[kNumParts] = {"products", "attention", "RoPE + KV write", "norms", "activation", "LoRA updates"};

LinearPlan linear_plan(const pybind11::tuple& t) {
  TORCH_CHECK(t.size() == 21, "a linear's plan is (weight, packed, packed_low, packed_high, codes, scales, qtype, block_rows, "
                              "panel_codes, panel_scales, invariant_panels, out_features, panel_rows, panel_min_rows, input_order, "
                              "int8_packed, int8_scales, int8_unit_scales, int8_zero_points, float8_inputs, float8_scale)");
  auto tensor = [&](int i) { return t[i].is_none() ? torch::Tensor() : t[i].cast<torch::Tensor>(); };
  LinearPlan plan;
  plan.weight = tensor(0);
  plan.packed = tensor(1);
  plan.packed_low = t[2].cast<int64_t>();
  plan.packed_high = t[3].cast<int64_t>();
  plan.codes = tensor(4);
  plan.scales = tensor(5);
  plan.qtype = t[6].cast<int64_t>();
  plan.block_rows = t[7].cast<int64_t>();
  if (!t[8].is_none()) {
    plan.panel_codes = t[8].cast<torch::Tensor>();
    plan.panel_scales = t[9].cast<torch::Tensor>();
  }
  plan.invariant = tensor(10);
  plan.out_features = t[11].cast<int64_t>();
  plan.panel_rows = t[12].cast<int64_t>();
  plan.panel_min_rows = t[13].cast<int64_t>();
  plan.input_order = tensor(14);
  plan.int8_packed = tensor(15);
  plan.int8_scales = tensor(16);
  plan.int8_unit_scales = tensor(17);
  plan.int8_zero_points = tensor(18);
  plan.float8_inputs = t[19].cast<bool>();
  plan.float8_scale = tensor(20);
  TORCH_CHECK(plan.panel_rows < 0 || plan.invariant.defined(), "a linear served by float panels needs them");
  TORCH_CHECK(plan.block_rows < 0 || plan.codes.defined(), "a linear served by blocks needs its codes");
  TORCH_CHECK(plan.weight.defined() || plan.codes.defined(), "a linear needs a weight or blocks");
  return plan;
}

class DecoderStack {
 public:
  DecoderStack(const std::vector<pybind11::tuple>& layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               double eps, double scale, torch::Tensor cos, torch::Tensor sin, bool batch_invariant)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        cos_(std::move(cos)), sin_(std::move(sin)), batch_invariant_(batch_invariant),
        gguf_matmul_(op<BlockProduct>("duet_gguf::matmul")),
        gguf_matmul_bf16_(op<BlockProduct>("duet_gguf::matmul_bf16")),
        gguf_dequantize_(op<Dequantize>("duet_gguf::dequantize")),
        linear_packed_(op<PackedProduct>("mkldnn::_linear_pointwise")),
        invariant_linear_(op<InvariantProduct>("duet_gguf::invariant_linear")),
        int8_linear_(op<Int8Product>("duet_gguf::int8_linear")),
        float8_rows_(op<Float8Rows>("duet_gguf::float8_rows")) {
    for (const auto& layer : layers) {
      TORCH_CHECK(layer.size() == 8, "a layer's plan is (input_norm, post_norm, qkv, o, gate_up, down, window, rotates)");
      layers_.push_back({layer[0].cast<torch::Tensor>(), layer[1].cast<torch::Tensor>(), linear_plan(layer[2]),
                         linear_plan(layer[3]), linear_plan(layer[4]), linear_plan(layer[5]), layer[6].cast<int64_t>(),
                         layer[7].cast<bool>()});
    }
  }

  // The first len(key_caches) layers from the first one's normalised input x and the residual
  // stream (added into in place): the last layer's MLP output, as LlamaForCausalLM.run_layers.
  // With a quantized cache, ``rotation`` takes attention's output out of the cache's basis.
  // With ``lora_slots`` (a row's LoRA adapter slot, -1 for none), each product adds its rows'
  // updates (lora_add) with lora_a[4 * layer + j] and lora_bt[4 * layer + j], j the product's
  // place in the layer (q/k/v, o, gate/up, down), as Linear.forward does.
  torch::Tensor run(torch::Tensor x, torch::Tensor residual, torch::Tensor positions,
                    const std::vector<torch::Tensor>& key_caches, const std::vector<torch::Tensor>& value_caches,
                    torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                    torch::Tensor query_start_loc, const std::vector<int64_t>& seq_ids, const CascadeGroups& cascade,
                    std::optional<torch::Tensor> rotation, std::optional<torch::Tensor> lora_slots,
                    const std::vector<std::vector<torch::Tensor>>& lora_a, const std::vector<std::vector<torch::Tensor>>& lora_bt) {
    TORCH_CHECK(key_caches.size() == value_caches.size() && key_caches.size() <= layers_.size(),
                "one key and one value cache per layer run, at most ", layers_.size());
    TORCH_CHECK(!lora_slots || (lora_a.size() >= 4 * key_caches.size() && lora_bt.size() == lora_a.size()),
                "an A and a B^T list per product of every layer run");
    lora_slots_ = lora_slots ? &*lora_slots : nullptr;
    lora_a_ = &lora_a;
    lora_bt_ = &lora_bt;
    const int64_t tokens = x.size(0), q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    torch::Tensor mlp_out;
    for (size_t index = 0; index < key_caches.size(); ++index) {
      const LayerPlan& layer = layers_[index];
      if (mlp_out.defined()) x = add_rms_norm(mlp_out, residual, layer.input_norm);
      // attention
      const size_t lora = 4 * index;
      torch::Tensor qkv = linear(x, layer.qkv, lora);
      auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
      torch::Tensor q = parts[0].view({tokens, num_heads_, head_dim_});
      torch::Tensor k = parts[1].view({tokens, num_kv_heads_, head_dim_});
      torch::Tensor v = parts[2].view({tokens, num_kv_heads_, head_dim_});
      timed(kRopeKV, [&] {
        rope_and_cache(q, k, v, positions, layer.rotates ? cos_ : no_rope_, layer.rotates ? sin_ : no_rope_,
                       key_caches[index], value_caches[index], slot_mapping);
      });
      torch::Tensor attended;
      timed(kAttention, [&] {
        attended = torch::empty_like(q);
        if (batch_invariant_) {  // every row as a prompt chunk's rows are computed (batch_invariant.py)
          TORCH_CHECK(prompt_attention(attended, q, key_caches[index], value_caches[index], block_tables, seq_lens,
                                       query_start_loc, seq_ids, scale_, layer.window, 0.0),
                      "batch-invariant attention does not take heads of ", head_dim_);
        } else {
          paged_attention(attended, q, key_caches[index], value_caches[index], block_tables, seq_lens, query_start_loc,
                          seq_ids, scale_, layer.window, cascade);
        }
        if (rotation) attended = torch::matmul(attended, *rotation);  // out of the cache's basis
      });
      torch::Tensor attn_out = linear(attended.view({tokens, q_size}), layer.o, lora + 1);
      // MLP
      torch::Tensor hidden = add_rms_norm(attn_out, residual, layer.post_norm);
      torch::Tensor gate_up = linear(hidden, layer.gate_up, lora + 2);
      torch::Tensor activated;
      timed(kActivation, [&] {
        activated = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
        silu_and_mul(activated, gate_up.contiguous());
      });
      mlp_out = linear(activated, layer.down, lora + 3);
    }
    return mlp_out;
  }

  void set_profiling(bool on) { profiling_ = on; }

  // Seconds spent in each part since the last call, by part name (profiling on), then zeroed.
  std::vector<std::pair<std::string, double>> take_times() {
    std::vector<std::pair<std::string, double>> out;
    for (int part = 0; part < kNumParts; ++part) {
      out.emplace_back(kPartNames[part], seconds_[part]);
      seconds_[part] = 0.0;
    }
    return out;
  }

 private:
  template <typename Body>
  void timed(Part part, Body&& body) {
    if (!profiling_) {
      body();
      return;
    }
    const auto started = std::chrono::steady_clock::now();
    body();
    seconds_[part] += std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }

  // residual += x in place; the normalised sum, in x's memory (kernels/fused.add_rms_norm).
  torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor& residual, const torch::Tensor& weight) {
    torch::Tensor out = x.contiguous();
    timed(kNorms, [&] { rms_norm(out, residual, weight, eps_, true); });
    return out;
  }

  // Linear.forward, path for path; then the LoRA updates of product ``lora`` where a step has them
  // (on the input as given: the weight's own column order is the product's alone).
  torch::Tensor linear(const torch::Tensor& given, const LinearPlan& plan, size_t lora) {
    torch::Tensor out;
    timed(kProducts, [&] {
      const torch::Tensor quantized =
          plan.float8_inputs
              ? float8_rows_.call(given, plan.float8_scale.defined() ? std::optional<torch::Tensor>(plan.float8_scale) : std::nullopt)
              : given;
      const torch::Tensor x = plan.input_order.defined() ? quantized.index_select(-1, plan.input_order) : quantized;
      const int64_t rows = x.size(0);
      if (plan.int8_packed.defined()) {  // W8A8: quantized per token, in integers
        out = int8_linear_.call(x, plan.int8_packed, plan.int8_scales, plan.int8_unit_scales, plan.int8_zero_points);
      } else if (!plan.weight.defined()) {  // quantized at load
        if (rows > plan.block_rows)
          out = at::linear(x, gguf_dequantize_.call(plan.codes, plan.scales, plan.qtype, x.size(1)).to(x.scalar_type()));
        else
          out = gguf_matmul_
                    .call(x.to(torch::kFloat32), plan.codes, plan.scales, plan.qtype, plan.panel_min_rows, plan.panel_codes,
                          plan.panel_scales)
                    .to(x.scalar_type());
      } else if (rows <= plan.block_rows) {
        out = x.scalar_type() == torch::kBFloat16  // rounded to bf16 in the call
                  ? gguf_matmul_bf16_.call(x, plan.codes, plan.scales, plan.qtype, plan.panel_min_rows, plan.panel_codes,
                                           plan.panel_scales)
                  : gguf_matmul_.call(x, plan.codes, plan.scales, plan.qtype, plan.panel_min_rows, plan.panel_codes,
                                      plan.panel_scales);
      } else if (rows <= plan.panel_rows) {
        out = invariant_linear_.call(x, plan.invariant, plan.out_features).to(x.scalar_type());
      } else if (plan.packed_low <= rows && rows <= plan.packed_high) {
        out = linear_packed_.call(x, plan.packed, std::nullopt, "none", c10::List<std::optional<c10::Scalar>>(), "");
      } else {
        out = at::linear(x, plan.weight);
      }
    });
    if (lora_slots_ != nullptr) {
      timed(kLoRA, [&] {
        out = out.contiguous();
        lora_add(out, given.contiguous(), *lora_slots_, (*lora_a_)[lora], (*lora_bt_)[lora]);
      });
    }
    return out;
  }

  std::vector<LayerPlan> layers_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor cos_, sin_;
  torch::Tensor no_rope_ = torch::empty({1, 0}, torch::kFloat32);  // a NoPE layer's tables: no width
  bool batch_invariant_;
  c10::TypedOperatorHandle<BlockProduct> gguf_matmul_, gguf_matmul_bf16_;
  c10::TypedOperatorHandle<Dequantize> gguf_dequantize_;
  c10::TypedOperatorHandle<PackedProduct> linear_packed_;
  c10::TypedOperatorHandle<InvariantProduct> invariant_linear_;
  c10::TypedOperatorHandle<Int8Product> int8_linear_;
  c10::TypedOperatorHandle<Float8Rows> float8_rows_;
  // This run's LoRA updates (run's arguments, alive while it runs; no slots: none).
  const torch::Tensor* lora_slots_ = nullptr;
  const std::vector<std::vector<torch::Tensor>>* lora_a_ = nullptr;
  const std::vector<std::vector<torch::Tensor>>* lora_bt_ = nullptr;
  bool profiling_ = false;
  std::array<double, kNumParts> seconds_{};
};

}  // namespace

void bind_decoder_stack(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<const std::vector<py::tuple>&, int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor, bool>())
      .def("run", &DecoderStack::run, py::call_guard<py::gil_scoped_release>())
      .def("set_profiling", &DecoderStack::set_profiling)
      .def("take_times", &DecoderStack::take_times);
}

}  // namespace duet_cpu
