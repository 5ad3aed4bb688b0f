"""A Llama model's decoder layers in one C++ call, for steps whose queries are all short.

A decode step (or a speculative verification) runs the layers through ``DecoderStack``
(``kernels/csrc/decoder_stack.cpp``): the same kernels, in the same order, on the same
tensors as ``LlamaForCausalLM.run_layers``' loop, with each product's path chosen by
``Linear.plan()`` as ``Linear.forward`` chooses it, so the outputs are bit for bit the
loop's; only the loop's Python (module calls, splits, views, ~300 of them a step) is gone,
and the GIL with it while the layers run. A step with LoRA adapters' rows (``duet.lora``) runs
here too, each product adding their updates with the same C++ call ``Linear`` makes. Prompt
chunks keep the Python loop (their Python is a small share of their step; their attention is
``cpu_ops``' prompt kernel), as do models whose layers are not plain Llama ones
(tensor-parallel ranks, MoE, Qwen's q/k/v biases and q/k norms), W8A8 products not in integers
at every row count, GPU models, and every model where the C++ kernels are unavailable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from duet.kernels import cpu_ops
from duet.kernels.kv_quant import is_quantized, rotation
from duet.kernels.torch_attention import MAX_BATCHED_QUERY_LEN
from duet.models.linear import Linear

if TYPE_CHECKING:
    from duet.kernels import AttentionMetadata
    from duet.lora import LoRAStep
    from duet.models.llama import LlamaForCausalLM


class DecoderStack:
    """The C++ stack over a model's layers (``build``), and when a step may take it."""

    def __init__(self, native, head_dim: int, linear_names: list[str]) -> None:
        self.native = native
        self.head_dim = head_dim
        self.linear_names = linear_names  # each layer's products' module names, in the stack's order (LoRA's keys)

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> DecoderStack | None:
        """The stack over ``model``'s layers, or None where they must run in Python."""
        from duet.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, RMSNorm

        layers = list(model.layers)
        if not layers or model.rotary.cos.device.type != "cpu":
            return None
        for layer in layers:
            if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention:
                return None
            if type(layer.mlp) is not LlamaMLP or any(type(n) is not RMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm)):
                return None
            if layer.self_attn.qkv_bias is not None or layer.self_attn.q_norm is not None:  # Qwen's parts: Python
                return None
            if layer.self_attn.o_bias is not None or layer.mlp.down_bias is not None:  # projections' biases: Python
                return None
            if layer.self_attn.softcap is not None or layer.residual_multiplier is not None:  # Gemma 2's caps, Granite's multiplier
                return None
            if any(type(linear) is not Linear for linear in _linears(layer)):
                return None
            if any(
                linear.input_quantization is not None and not (linear.int8_at_every_row or linear.float8_inputs_in_one_call)
                for linear in _linears(layer)
            ):
                return None  # static int8 inputs, and rows scaled over other ranks' features: Python
        ops = cpu_ops.load()
        if ops is None or cpu_ops.load_gguf() is None:  # the stack reaches the block products through their operators
            return None
        attention = layers[0].self_attn
        plans = [
            (
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *(linear.plan() for linear in _linears(layer)),
                layer.self_attn.window or 0, layer.self_attn.rotates,
            )
            for layer in layers
        ]
        native = ops.DecoderStack(
            plans, attention.num_heads, attention.num_kv_heads, attention.head_dim,
            layers[0].input_layernorm.eps, attention.scale, model.rotary.cos, model.rotary.sin, attention.batch_invariant,
        )
        names = {module: name for name, module in model.named_modules()}
        return cls(native, attention.head_dim, [names[linear] for layer in layers for linear in _linears(layer)])

    @staticmethod
    def takes(x: torch.Tensor, metadata: AttentionMetadata) -> bool:
        """Whether this step's layers can run here: every query short (the C++ attention's)."""
        return metadata.max_query_len <= MAX_BATCHED_QUERY_LEN and x.device.type == "cpu"

    def run(self, x, residual, positions, kv_caches, metadata: AttentionMetadata, lora: LoRAStep | None = None) -> torch.Tensor:
        """``LlamaForCausalLM.run_layers`` for a step it ``takes`` (``lora``: the step's adapters, native)."""
        key_caches = [key for key, _ in kv_caches]
        value_caches = [value for _, value in kv_caches]
        out_of_basis = rotation(self.head_dim, x.dtype, x.device) if is_quantized(key_caches[0]) else None
        slots, a, bt = None, [], []
        if lora is not None:
            slots = lora.row_slots
            for name in self.linear_names[: 4 * len(kv_caches)]:
                a_list, bt_list = lora.weights(name)
                a.append(a_list)
                bt.append(bt_list)
        return self.native.run(
            x, residual, positions, key_caches, value_caches, metadata.slot_mapping, metadata.block_tables,
            metadata.seq_lens, metadata.query_start_loc, list(range(metadata.num_seqs)), metadata.cascade, out_of_basis,
            slots, a, bt,
        )

    def profile(self, on: bool) -> None:
        """Time each part of the layers (``take_times``) from now on, or stop timing."""
        self.native.set_profiling(on)

    def take_times(self) -> dict[str, float]:
        """Seconds in each part (products, attention, RoPE + KV write, norms, activation) since the
        last call, while profiling."""
        return dict(self.native.take_times())


def _linears(layer) -> tuple[Linear, Linear, Linear, Linear]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
