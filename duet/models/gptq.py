"""GPTQ checkpoints (``quant_method: gptq``, as GPTQModel writes them), read into the
codes and scales ``duet.models.packed`` makes blocks of: never a float copy.

A GPTQ linear ``x`` ships ``x.qweight`` (int32 ``[in * bits / 32, out]``: code ``i`` of each word
is input feature ``32 / bits * row + i`` at bits ``bits * i``), ``x.scales`` (``[groups, out]``),
``x.qzeros`` (int32 ``[groups, out * bits / 32]``, packed along the output features the same
way) and ``x.g_idx`` (each input feature's group). Its weight is ``s * (q - z)`` with the group's
scale ``s`` and zero ``z``; the ``gptq`` checkpoint format (v1) stores ``z - 1``, ``gptq_v2``
stores ``z``.

- Every group's zero at the middle (``2^(bits-1)``: GPTQ's ``sym``, and any checkpoint whose
  zeros happen to be) gives compressed-tensors' symmetric codes: Q4_1 or Q8_0 blocks, exact.
- Other zeros (4 bits): ``q - z`` as int8 codes, Q8_0 blocks with scale ``s``, exact (an 8-bit
  ``q - z`` spans 9 bits: refused, naming the field).
- ``desc_act`` (activation order): ``g_idx`` is not ``feature // group_size``, unless the groups
  were fixed first (``static_groups``). Not built yet: a ``g_idx`` out of order is refused at
  load, naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch

from duet.errors import DamagedCheckpointError, UnsupportedCheckpointError

SUFFIXES = ("qweight", "scales", "qzeros")
FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format: what its stored zeros lack


def read_gptq(config: dict, path: Path, refuse) -> tuple[int, int | None, int]:
    """``(num_bits, group_size or None for a scale per channel, zero offset)`` from a GPTQ
    ``quantization_config``; ``refuse(field, value, wanted)`` raises for what duet does not read."""
    bits, group_size = config.get("bits"), config.get("group_size", -1)
    checkpoint_format = config.get("checkpoint_format") or config.get("format") or "gptq"
    if bits not in (4, 8):
        refuse("bits", bits, "4 or 8")
    if checkpoint_format not in FORMATS:
        refuse("checkpoint_format", checkpoint_format, " or ".join(repr(name) for name in FORMATS))
    if not isinstance(group_size, int) or (group_size != -1 and (group_size <= 0 or group_size % 32)):
        refuse("group_size", group_size, "-1 (a scale per channel) or a multiple of 32")
    return bits, None if group_size == -1 else group_size, FORMATS[checkpoint_format]


def gptq_name(part: str, suffix: str) -> str:
    """``model.x.weight``'s GPTQ tensor ``model.x.<suffix>``."""
    return part.removesuffix(".weight") + "." + suffix


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words' codes, each word's ``32 / bits`` codes consecutive along ``dim``."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    if dim == 0:
        codes = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)  # [rows, per_word, cols]
        return codes.reshape(-1, words.shape[1])
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, cols, per_word]
    return codes.reshape(words.shape[0], -1)


def gptq_codes(
    state: dict[str, torch.Tensor], part: str, bits: int, group_size: int | None, zero_offset: int, path: Path
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """A GPTQ weight's codes ``[out, in]`` and scales per 32-weight block ``[out, in / 32]``
    (fp32), and whether they are symmetric: unsigned codes about ``2^(bits-1)`` (uint8) when
    every zero is there, else ``q - z`` (int8)."""
    for suffix in SUFFIXES:
        if gptq_name(part, suffix) not in state:
            raise DamagedCheckpointError(f"{path}: tensor {gptq_name(part, suffix)} is missing")
    qweight, scales, qzeros = (state[gptq_name(part, suffix)] for suffix in SUFFIXES)
    per_word = 32 // bits
    in_features, out_features = qweight.shape[0] * per_word, qweight.shape[1]
    group = group_size or in_features
    num_groups = -(-in_features // group)
    expected = {
        "qweight": (qweight, torch.int32, (in_features // per_word, out_features)),
        "scales": (scales, None, (num_groups, out_features)),
        "qzeros": (qzeros, torch.int32, (num_groups, -(-out_features // per_word))),
    }
    for suffix, (tensor, dtype, shape) in expected.items():
        if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
            raise DamagedCheckpointError(
                f"{path}: {gptq_name(part, suffix)} is {tensor.dtype} {tuple(tensor.shape)}, where {bits}-bit GPTQ codes of "
                f"{in_features} features in groups of {group} give {dtype or 'floats'} {shape}"
            )
    if in_features % group:
        raise UnsupportedCheckpointError(f"{path}: {part} has {in_features} input features, not whole groups of {group}")
    g_idx = state.get(gptq_name(part, "g_idx"))
    in_order = torch.arange(in_features) // group
    if g_idx is not None and not torch.equal(g_idx.long(), in_order):
        raise UnsupportedCheckpointError(f"{path}: {gptq_name(part, 'g_idx')} is not in order (activation order is not built yet)")
    codes = _unpack(qweight, bits, 0).T  # [out, in]
    zeros = _unpack(qzeros, bits, 1)[:, :out_features].T.to(torch.int16) + zero_offset  # [out, groups]
    block_scales = scales.float().T.repeat_interleave(group // 32, dim=1)
    middle = 1 << (bits - 1)
    if bool((zeros == middle).all()):
        return codes.to(torch.uint8), block_scales, True
    if bits == 8:
        raise UnsupportedCheckpointError(f"{path}: {gptq_name(part, 'qzeros')} holds 8-bit zero points off the middle (sym: false); duet reads 4-bit ones")
    signed = codes.to(torch.int16) - zeros.repeat_interleave(group, dim=1)  # q - z, in -16..15
    return signed.to(torch.int8), block_scales, False
