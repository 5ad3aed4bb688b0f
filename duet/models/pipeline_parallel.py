"""Pipeline parallelism applied to a loaded Llama from outside its definition: a stage keeps a
contiguous run of the decoder layers (and their KV cache), the first also the embedding, the
last also the final norm and LM head. Between stages travel a layer's MLP output and the
residual stream, before the next layer's fused add-and-norm, which the next stage runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from duet.config import ConfigError
from duet.models.llama import LlamaForCausalLM
from duet.models.tensor_parallel import split_range


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    if num_layers < num_stages:
        raise ConfigError(f"pipeline_parallel_size={num_stages} needs at least as many layers; the model has {num_layers}")
    part = split_range(num_layers, num_stages, stage)
    return range(part.start, part.stop)


class PipelineStage(nn.Module):
    """Stage ``stage`` of ``num_stages`` of ``model`` (which keeps only that stage's modules;
    ``model.arch.num_layers`` becomes the stage's layer count: what its KV cache holds)."""

    def __init__(self, model: LlamaForCausalLM, stage: int, num_stages: int) -> None:
        super().__init__()
        self.first, self.last = stage == 0, stage == num_stages - 1
        layers = stage_layers(model.arch.num_layers, num_stages, stage)
        model.layers = nn.ModuleList(model.layers[index] for index in layers)
        if not self.first:
            model.embed_tokens = None
        if not self.last:
            model.norm = model.lm_head = None
        model.arch = dataclasses.replace(model.arch, num_layers=len(layers))
        self.model = model
        self.layers_held = layers  # of the whole model's (a LoRA adapter's tensors are named by them)

    @property
    def arch(self):
        return self.model.arch

    @property
    def whole_arch(self):
        return self.model.whole_arch

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata,
        logits_indices: torch.Tensor,
        received: torch.Tensor | None = None,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """The last stage: logits for ``logits_indices``; the others: ``[2, tokens, hidden]``,
        the last layer's MLP output and the residual stream, for the next stage (whose input is
        ``received``: the same, from the stage before)."""
        model = self.model
        if self.first:
            residual = model.embed(input_ids)
            x = model.layers[0].input_layernorm(residual)
        else:
            mlp_out, residual = received[0], received[1].clone()
            x = model.layers[0].input_layernorm(mlp_out, residual)
        mlp_out = model.run_layers(x, residual, positions, kv_caches, metadata, on_layer_done)
        if not self.last:
            return torch.stack([mlp_out, residual])
        return model.logits(model.norm(mlp_out, residual)[logits_indices])
