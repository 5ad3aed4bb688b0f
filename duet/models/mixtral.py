"""Mixture of experts (Mixtral, Qwen 3 MoE): a decoder whose sparse layers' MLP is a router over
``num_experts`` SwiGLU experts, of which each token takes its ``num_experts_per_tok`` best,
weighted; Qwen 3 MoE keeps a dense MLP in some layers (``sparse_layers``), and Qwen 2 MoE adds a
shared expert every token takes, scaled by a sigmoid gate of its own.

The routing is transformers' (``MixtralTopKRouter``, ``Qwen3MoeTopKRouter``): softmax of the
router's logits in fp32, top-k, the k weights renormalised to sum to one where the family
does (``norm_topk_prob``); and so is the sum: a token's weighted expert
outputs are added into zeros in the experts' index order. With expert parallelism each rank
holds a contiguous range of experts (``local_experts``) and returns the sum of its own, which
the ranks then add (``duet.models.tensor_parallel``): a token's two experts on two ranks sum
to what one process gives, to the bit. Tensor parallelism without it splits every expert's
features instead (``keep_features``), as a dense MLP's: each rank adds its part of each down
projection, and the ranks' parts are added (the sum's order differs from one process's).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from duet.kernels import cpu_ops
from duet.kernels.fused import silu_and_mul
from duet.models.linear import Linear
from duet.models.linear_rules import float_panels
from duet.models.llama import LlamaArch, LlamaForCausalLM, LlamaMLP, by_row
from duet.models.module import Module


@dataclass(frozen=True)
class MixtralArch(LlamaArch):
    """A Llama's shape plus its experts (``intermediate_size`` is one expert's)."""

    num_experts: int
    num_experts_per_tok: int
    _: KW_ONLY
    norm_topk_prob: bool = True  # the top-k weights renormalised to sum to one
    sparse_layers: tuple[int, ...] | None = None  # the layers with experts (None: every one)
    dense_intermediate_size: int = 0  # the dense MLP's features in the other layers
    shared_expert_intermediate_size: int = 0  # a shared expert's features (Qwen 2 MoE, Granite MoE shared); 0: none
    shared_expert_gated: bool = True  # its output scaled by sigmoid of a gate (Qwen 2 MoE's; Granite's is not)

    @classmethod
    def from_hf_config(cls, config, **parts) -> MixtralArch:
        llama = LlamaArch.from_hf_config(config, checkpoint_names="mixtral", **parts)
        return cls(**vars(llama), num_experts=config.num_local_experts, num_experts_per_tok=config.num_experts_per_tok)

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers is None or layer in self.sparse_layers


class MixtralMoE(Module):
    """The router and the experts ``local_experts`` (all of them unless expert-parallel)."""

    def __init__(self, arch: MixtralArch) -> None:
        super().__init__()
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.hidden_size = arch.hidden_size
        self.intermediate_size = arch.intermediate_size
        self.local_experts = range(arch.num_experts)
        self.gate = Linear(arch.hidden_size, arch.num_experts)
        # Experts stacked as the checkpoint's rows concatenate: w1 then w3 (gate, up) per expert, and w2.
        self.w13 = nn.Parameter(torch.empty(arch.num_experts * 2 * arch.intermediate_size, arch.hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(arch.num_experts * arch.hidden_size, arch.intermediate_size), requires_grad=False)
        self.invariant_panels: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per local expert: w13's, w2's
        # A shared expert, which every token takes: Qwen 2 MoE's times sigmoid of its gate's one output.
        shared = arch.shared_expert_intermediate_size
        self.shared_expert = LlamaMLP(arch, shared) if shared else None
        self.shared_expert_gate = Linear(arch.hidden_size, 1) if shared and arch.shared_expert_gated else None

    def make_batch_invariant(self) -> None:
        """Every expert's two products in one order of additions for each output, whatever its
        rows (``duet.models.batch_invariant``): its w13 and w2 laid out for ``invariant_linear``.
        The router's gate is a ``Linear`` (made so with the others), and a token adds its experts'
        outputs in their index order whatever else the batch holds."""
        width = cpu_ops.load_gguf().invariant_panel_width()
        experts = len(self.local_experts)
        w13 = self.w13.detach().view(experts, 2 * self.intermediate_size, self.hidden_size)
        w2 = self.w2.detach().view(experts, self.hidden_size, self.intermediate_size)
        self.invariant_panels = [(float_panels(w13[index], width), float_panels(w2[index], width)) for index in range(experts)]

    def _expert(self, index: int, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        if self.invariant_panels is None:
            return F.linear(silu_and_mul(F.linear(x, w13[index])), w2[index])
        ops, (gate_up, down) = cpu_ops.load_gguf(), self.invariant_panels[index]
        hidden = silu_and_mul(ops.invariant_linear(x, gate_up, 2 * self.intermediate_size).to(x.dtype))
        return ops.invariant_linear(hidden, down, self.hidden_size).to(x.dtype)

    def keep_experts(self, experts: range) -> None:
        """Keep only these experts' weights (an expert-parallel rank's share)."""
        gate_up, hidden = 2 * self.intermediate_size, self.hidden_size
        first = experts.start - self.local_experts.start
        self.w13 = nn.Parameter(self.w13[first * gate_up : (first + len(experts)) * gate_up].contiguous(), requires_grad=False)
        self.w2 = nn.Parameter(self.w2[first * hidden : (first + len(experts)) * hidden].contiguous(), requires_grad=False)
        self.local_experts = experts

    def keep_features(self, features: range) -> None:
        """Keep only these intermediate features of every expert (a tensor-parallel rank's share
        without expert parallelism): its rows of w1 and w3, its columns of w2. The rank's output
        is then its part of each expert's down projection, which the ranks add."""
        experts, hidden, width = len(self.local_experts), self.hidden_size, self.intermediate_size
        w13 = self.w13.view(experts, 2, width, hidden)[:, :, features.start : features.stop]
        w2 = self.w2.view(experts, hidden, width)[:, :, features.start : features.stop]
        self.w13 = nn.Parameter(w13.reshape(-1, hidden).contiguous(), requires_grad=False)
        self.w2 = nn.Parameter(w2.reshape(-1, len(features)).contiguous(), requires_grad=False)
        self.intermediate_size = len(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        w13 = self.w13.view(len(self.local_experts), 2 * self.intermediate_size, self.hidden_size)
        w2 = self.w2.view(len(self.local_experts), self.hidden_size, self.intermediate_size)
        for index, expert in enumerate(self.local_experts):
            tokens, slots = torch.where(chosen == expert)
            if tokens.numel() == 0:
                continue
            hidden = self._expert(index, x[tokens], w13, w2)
            out.index_add_(0, tokens, (hidden * weights[tokens, slots, None]).to(out.dtype))
        if self.shared_expert_gate is not None:
            gate = by_row(torch.sigmoid, self.shared_expert_gate(x), self.invariant_panels is not None)  # as LlamaMLP's GeGLU
            out = out + gate * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out


class MixtralForCausalLM(LlamaForCausalLM):
    """The decoder with each sparse layer's MLP a ``MixtralMoE`` (the others' a dense one)."""

    def __init__(self, arch: MixtralArch, max_positions: int) -> None:
        super().__init__(arch, max_positions)
        for index, layer in enumerate(self.layers):
            layer.mlp = MixtralMoE(arch) if arch.is_sparse(index) else LlamaMLP(arch, arch.dense_intermediate_size)
