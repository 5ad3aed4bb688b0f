"""Rotary position embeddings: each family's frequencies (transformers' own functions compute
the scaled ones, so they are the checkpoint's definition to the bit) as fp32 cos/sin tables,
and for the scalings that depend on a sequence's length (longrope, dynamic NTK) which rows
each token of a step rotates by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from duet.errors import UnsupportedCheckpointError
from duet.kernels import AttentionMetadata

if TYPE_CHECKING:
    from duet.models.llama import LlamaArch


# RoPE scalings whose tables are fixed per position, then those that depend on the sequence's length.
_ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope", "dynamic")


def rope_scaling(config, rope: dict, layer_type: str | None = None) -> dict:
    """The ``rope_inv_freq`` and ``rope_attention_factor`` of a scaled RoPE (``rope``: the
    config's RoPE parameters, of ``layer_type`` where they are per layer type), computed by
    transformers' own functions for its type (the frequencies are the checkpoint's definition);
    none for a plain one."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("default", None):
        return {}
    if rope_type not in _ROPE_SCALINGS:
        raise UnsupportedCheckpointError(f"config.json's rope scaling {rope_type!r} is not supported: duet runs {('default', *_ROPE_SCALINGS)}")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    layer = {"layer_type": layer_type} if layer_type else {}
    if rope_type == "dynamic":  # the plain frequencies up to the config's length, recomputed past it
        return {"rope_dynamic_factor": float(rope["factor"]), "rope_original_max": int(config.max_position_embeddings)}
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **layer)
    parts = {"rope_inv_freq": tuple(inv_freq.float().tolist()), "rope_attention_factor": float(factor)}
    if rope_type == "longrope":  # the short frequencies, and the long ones as transformers computes them
        original = int(rope["original_max_position_embeddings"])
        long_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=original + 1, **layer)
        parts |= {"rope_long_inv_freq": tuple(long_inv_freq.float().tolist()), "rope_original_max": original}
    return parts


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE tables (fp32), indexed by position: ``arch``'s frequencies (scaled, or
    those of its ``rope_theta``) and the factor on its tables; ``local``: its windowed layers'
    (plain, of ``local_rope_theta``); ``rotates=False``: a NoPE layer's (no width). A table half
    as wide as ``rotary_dim`` rotates only a head's first ``rotary_dim`` features (the kernels
    take the width from the table). A longrope's long tables follow its short ones (rows
    ``max_positions`` on); ``for_step`` says which row each token reads."""

    def __init__(self, arch: LlamaArch, max_positions: int, local: bool = False, rotates: bool = True) -> None:
        super().__init__()
        # On the CPU also under the meta device (``.to`` moves them): torch's meta reference
        # ops import torch._dynamo, over a second of a replica's start.
        with torch.device("cpu"):
            self._build(arch, max_positions, local, rotates)

    def _build(self, arch: LlamaArch, max_positions: int, local: bool, rotates: bool) -> None:
        dim = self.dim = arch.rotary_dim or arch.head_dim  # the tables' width is half of it
        scaled = None if local else arch.rope_inv_freq
        if not rotates:  # a NoPE layer's: tables of no width
            inv_freq, local = torch.zeros(0), True
        elif scaled is not None:
            inv_freq = torch.tensor(scaled, dtype=torch.float32)
        else:
            theta = arch.local_rope_theta if local else arch.rope_theta
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        self.factor = 1.0 if local else arch.rope_attention_factor
        cos, sin = self._tables(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.switch_len = None if local else arch.rope_original_max
        self.long_offset = None
        if arch.rope_long_inv_freq is not None and not local:
            long_inv_freq = torch.tensor(arch.rope_long_inv_freq, dtype=torch.float32)
            long_cos, long_sin = self._tables(torch.arange(max_positions, dtype=torch.float32), long_inv_freq)
            cos, sin, self.long_offset = torch.cat([cos, long_cos]), torch.cat([sin, long_sin]), max_positions
        self.dynamic_factor = None if local else arch.rope_dynamic_factor
        self.theta = arch.rope_theta
        self.register_buffer("cos", cos.contiguous(), persistent=False)
        self.register_buffer("sin", sin.contiguous(), persistent=False)

    def _tables(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``positions`` (fp32) times ``inv_freq``, times the tables' factor."""
        freqs = positions[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.factor != 1.0:
            cos, sin = cos * self.factor, sin * self.factor
        return cos, sin

    def for_step(self, positions: torch.Tensor, metadata: AttentionMetadata) -> tuple[torch.Tensor, RotaryEmbedding | RopeRows]:
        """The table rows this step's tokens rotate by and the tables holding them: ``positions``
        and this module's, but where the RoPE depends on the sequence's length L (a token's
        ``max(position + 1, its sequence's prompt length)``, ``metadata.prompt_lens``): past
        ``switch_len``, a longrope's long rows; a dynamic one's rows computed for this step
        (``RopeRows``, one a token)."""
        if self.switch_len is None:
            return positions, self
        lengths = positions + 1
        if metadata.prompt_lens is not None:
            floors = torch.repeat_interleave(
                torch.tensor(metadata.prompt_lens, dtype=torch.int64), torch.tensor(metadata.query_lens, dtype=torch.int64)
            )
            lengths = torch.maximum(lengths, floors.to(positions.device))
        longer = lengths > self.switch_len
        if self.long_offset is not None:
            return positions + longer * self.long_offset, self
        if not bool(longer.any()):
            return positions, self
        cos, sin = self.cos[positions], self.sin[positions]
        for length in torch.unique(lengths[longer]).tolist():
            rows = lengths == length
            cos[rows], sin[rows] = self._tables(positions[rows].float(), self.dynamic_inv_freq(length).to(positions.device))
        return torch.arange(positions.numel(), device=positions.device), RopeRows(cos, sin)

    def dynamic_inv_freq(self, length: int) -> torch.Tensor:
        """Dynamic NTK's frequencies for a sequence of ``length`` past ``switch_len``, in
        transformers' arithmetic (fp32 tensors from an int64 length), so they match to the bit."""
        seq_len = torch.tensor(length, dtype=torch.int64)
        factor, dim = self.dynamic_factor, self.dim
        base = self.theta * ((factor * seq_len / self.switch_len) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


@dataclass
class RopeRows:
    """One step's RoPE tables, a row a token (``RotaryEmbedding.for_step``)."""

    cos: torch.Tensor
    sin: torch.Tensor
