"""GPTQ and AWQ checkpoints (``quant_method: gptq`` or ``awq``, as GPTQModel writes them; AWQ in
AutoAWQ's ``gemm``, ``gemv`` and ``gemv_fast`` formats and llm-awq's), read into the codes and
scales ``duet.models.packed`` makes blocks of: never a float copy.

Both ship, per linear ``x``, ``x.qweight`` (codes in int32 words), ``x.scales`` (``[groups,
out]``) and ``x.qzeros`` (int32 ``[groups, out * bits / 32]``, a zero per group and output
feature, packed along the output features); the weight is ``s * (q - z)``. AWQ's ``gemv``
transposes all three (below).

- **GPTQ** packs ``qweight`` along the input features (``[in * bits / 32, out]``: code ``i`` of
  a word is input feature ``32 / bits * row + i``, at bits ``bits * i``) and its zeros in the
  same order; ``x.g_idx`` gives each input feature's group. Its ``gptq`` format (v1) stores
  ``z - 1``, ``gptq_v2`` stores ``z``. 4 and 8 bits.
- **AWQ** (``version: gemm``) packs ``qweight`` along the output features (``[in, out / 8]``)
  with the codes of a word's eight features in the order ``AWQ_ORDER``, and its zeros the same
  way; groups are in order. 4 bits.
- **AWQ** (``version: gemv``) keeps the output features first: ``qweight`` ``[out, in / 8]``
  packed along the input features in order (code ``i`` of a word is input feature ``8 * word +
  i``), ``qzeros`` ``[out, words]`` packed along the groups likewise and ``scales`` ``[out, 8 *
  words]``, both padded past the last group (``words`` at least ``groups / 8``: AutoAWQ rounds it
  up for its kernel). 4 bits.
- **AWQ** (``version: gemv_fast``, and llm-awq's ``version: llm-awq``, whose zeros tensor is
  ``x.scaled_zeros``) keeps the output features first and packs four rows' codes in each int16
  (``qweight`` ``[out / 4, in]``: code ``b`` of word ``[r, 64 c + a]`` is row ``4 r + i`` and
  column ``64 c + j`` where ``4 a + b = 64 i + j``, and each 32 columns' codes are permuted twice
  within them: ``GEMV_FAST_PERMUTATIONS``). Its scales and zeros are ``[groups, out]`` floats
  padded past the last group, and each zero is already scaled: the weight is ``s * q + m``, ``m``
  the stored ``-s * z`` rounded to the checkpoint's dtype, which the format's kernels add as it
  is. So its blocks are Q4_1's, ``d = s`` and min ``m``, exact. 4 bits.

A weight whose zeros are all at the middle (``2^(bits-1)``: a symmetric scheme, or zeros that
happen to be) gives compressed-tensors' symmetric codes, Q4_1 or Q8_0 blocks, exact; other
zeros at 4 bits ``q - z`` as int8 codes, Q8_0 blocks with scale ``s``, exact; at 8 bits (``q -
z`` spans 9 bits) the codes ``q`` with ``s`` and ``z`` beside each block, the kernels' Q8Z
blocks, exact likewise. GPTQ's activation order (``desc_act``) puts input features in
groups out of order (``g_idx`` other than ``feature // group_size``; not when its groups were
fixed first, ``static_groups``): the codes are read with their input features sorted by group
(``input_order``), and the Linear takes its input in that order (``Linear.input_order``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

import torch

from duet.errors import DamagedCheckpointError, UnsupportedCheckpointError

GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format: what its stored zeros lack
AWQ_VERSIONS = ("gemm", "gemv", "gemv_fast", "llm-awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output feature (of 8) each code of an AWQ word holds
# gemv_fast's two permutations of each 32 columns' codes, as (split, order): the codes viewed as
# ``split``, their axes taken in ``order`` (an axis of the 32's index each); undone last to first.
GEMV_FAST_PERMUTATIONS = (((4, 4, 2), (1, 0, 2)), ((4, 4, 2), (0, 2, 1)))


class WeightCodes(NamedTuple):
    """A packed weight as ``duet.models.packed`` makes blocks of it: codes ``[out, in]`` and fp32
    scales per 32-weight block ``[out, in / 32]``, and what the weight is made of them."""

    codes: torch.Tensor
    scales: torch.Tensor
    symmetric: bool  # unsigned codes about 2^(bits-1) (uint8); else q - z at 4 bits (int8), q at 8 (uint8)
    order: torch.Tensor | None = None  # the order of their input features (``input_order``); None: as given
    zeros: torch.Tensor | None = None  # 8-bit codes with their zero point off the middle: each block's (fp32)
    mins: torch.Tensor | None = None  # the weight is ``scale * code + min``, codes 0..15 (uint8): each block's min (fp32)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a GPTQ or AWQ checkpoint packs its tensors."""

    method: str  # gptq or awq
    zero_offset: int = 0  # what the stored zeros lack
    version: str = "gemm"  # AWQ's (``AWQ_VERSIONS``)

    @property
    def zeros_name(self) -> str:
        return "scaled_zeros" if self.version == "llm-awq" else "qzeros"

    @property
    def suffixes(self) -> tuple[str, str, str]:
        return ("qweight", "scales", self.zeros_name)


def read_layout(config: dict, path: Path, refuse) -> tuple[int, int | None, Layout]:
    """``(num_bits, group_size or None for a scale per channel, layout)`` from a GPTQ or AWQ
    ``quantization_config``; ``refuse(field, value, wanted)`` raises for what duet does not read."""
    method = config.get("quant_method")
    bits, group_size = config.get("bits"), config.get("group_size", -1)
    if method == "awq":
        version = str(config.get("version") or config.get("checkpoint_format") or "gemm").lower()
        if version not in AWQ_VERSIONS:
            refuse("version", version, ", ".join(repr(name) for name in AWQ_VERSIONS))
        if bits != 4:
            refuse("bits", bits, "4")
        layout = Layout("awq", version=version)
    else:
        checkpoint_format = config.get("checkpoint_format") or config.get("format") or "gptq"
        if bits not in (4, 8):
            refuse("bits", bits, "4 or 8")
        if checkpoint_format not in GPTQ_FORMATS:
            refuse("checkpoint_format", checkpoint_format, " or ".join(repr(name) for name in GPTQ_FORMATS))
        layout = Layout("gptq", GPTQ_FORMATS[checkpoint_format])
    if not isinstance(group_size, int) or (group_size != -1 and (group_size <= 0 or group_size % 32)):
        refuse("group_size", group_size, "-1 (a scale per channel) or a multiple of 32")
    return bits, None if group_size == -1 else group_size, layout


def tensor_name(part: str, suffix: str) -> str:
    """``model.x.weight``'s tensor ``model.x.<suffix>``."""
    return part.removesuffix(".weight") + "." + suffix


def _unpack(words: torch.Tensor, bits: int, along_rows: bool, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words' codes, each word's ``32 / bits`` codes consecutive down its column
    (``along_rows``) or along its row, in ``order`` (code ``i`` is the ``order[i]``-th; None: in order)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    if order is not None:
        shifts = shifts[torch.tensor([order.index(position) for position in range(per_word)])]
    if along_rows:
        codes = (words.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)  # [rows, per_word, cols]
        return codes.reshape(-1, words.shape[1])
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, cols, per_word]
    return codes.reshape(words.shape[0], -1)


def input_order(g_idx: torch.Tensor | None, name: str, groups: torch.Tensor, path: Path) -> torch.Tensor | None:
    """The input features sorted by their group (``g_idx``, the tensor ``name``: GPTQ's, and
    compressed-tensors' ``weight_g_idx``; stable), None when already so. Sorted, they must fall in
    ``groups`` (each input feature's group, in order)."""
    if g_idx is None or torch.equal(g_idx.long(), groups):
        return None
    order = torch.argsort(g_idx.long(), stable=True)
    if g_idx.shape != groups.shape or not torch.equal(g_idx.long()[order], groups):
        raise DamagedCheckpointError(f"{path}: {name} does not put {len(groups)} input features in groups of equal size")
    return order


def layout_codes(state: dict[str, torch.Tensor], part: str, bits: int, group_size: int | None, layout: Layout, path: Path) -> WeightCodes:
    """A GPTQ or AWQ weight's codes and block scales: symmetric (unsigned codes about
    ``2^(bits-1)``) when every zero is there, else ``q - z`` at 4 bits and ``q`` beside each
    block's zero at 8; a gemv_fast weight's codes beside each block's min."""
    for suffix in layout.suffixes:
        if tensor_name(part, suffix) not in state:
            raise DamagedCheckpointError(f"{path}: tensor {tensor_name(part, suffix)} is missing")
    tensors = [state[tensor_name(part, suffix)] for suffix in layout.suffixes]

    def named(suffix: str) -> str:  # a tensor, as an error names it
        return f"{path}: {tensor_name(part, suffix)}"

    fast = layout.version in ("gemv_fast", "llm-awq")
    unpacked = _gemv_fast_codes if fast else _gemv_codes if layout.version == "gemv" else _codes
    codes, scales, zeros = unpacked(*tensors, bits, group_size, layout, named)
    in_features = codes.shape[1]
    if in_features % 32:
        raise UnsupportedCheckpointError(f"{path}: {part} has {in_features} input features, not whole blocks of 32")
    groups = torch.arange(in_features) // (group_size or in_features)  # the last one may be short (576 features in groups of 128)
    g_idx = tensor_name(part, "g_idx")
    order = input_order(state.get(g_idx), g_idx, groups, path) if layout.method == "gptq" else None
    if order is not None:  # the input features sorted by group: each group's features side by side
        codes = codes[:, order]
    block_scales = scales.float()[:, groups[::32]]
    if fast:  # zeros: the mins as stored
        return WeightCodes(codes.to(torch.uint8), block_scales, False, mins=zeros.float()[:, groups[::32]])
    if bool((zeros == 1 << (bits - 1)).all()):
        return WeightCodes(codes.to(torch.uint8), block_scales, True, order)
    if bits == 8:  # q - z spans 9 bits: q beside z (1..256 in the gptq format)
        return WeightCodes(codes.to(torch.uint8), block_scales, False, order, zeros[:, groups[::32]].float())
    signed = codes.to(torch.int16) - zeros[:, groups]  # q - z, in -16..15
    return WeightCodes(signed.to(torch.int8), block_scales, False, order)


def _codes(qweight, scales, qzeros, bits: int, group_size: int | None, layout: Layout, named) -> tuple[torch.Tensor, ...]:
    """GPTQ's and AWQ gemm's codes ``[out, in]``, scales and zeros ``[out, groups]``; ``named(suffix)``
    names a tensor in an error."""
    per_word = 32 // bits
    awq = layout.method == "awq"
    in_features, out_features = (qweight.shape[0], qweight.shape[1] * per_word) if awq else (qweight.shape[0] * per_word, qweight.shape[1])
    group = group_size or in_features
    num_groups = -(-in_features // group)
    expected = {
        "qweight": (qweight, torch.int32, (in_features, out_features // per_word) if awq else (in_features // per_word, out_features)),
        "scales": (scales, None, (num_groups, out_features)),
        "qzeros": (qzeros, torch.int32, (num_groups, -(-out_features // per_word))),
    }
    for suffix, (tensor, dtype, shape) in expected.items():
        if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
            raise DamagedCheckpointError(
                f"{named(suffix)} is {tensor.dtype} {tuple(tensor.shape)}, where {bits}-bit {layout.method.upper()} "
                f"codes of {in_features} features in groups of {group} give {dtype or 'floats'} {shape}"
            )
    packing = AWQ_ORDER if awq else None
    codes = _unpack(qweight, bits, along_rows=not awq, order=packing)  # [in, out]
    zeros = _unpack(qzeros, bits, along_rows=False, order=packing)[:, :out_features].to(torch.int16) + layout.zero_offset  # [groups, out]
    return codes.T, scales.T, zeros.T


def _gemv_codes(qweight, scales, qzeros, bits: int, group_size: int | None, layout: Layout, named) -> tuple[torch.Tensor, ...]:
    """AWQ gemv's codes ``[out, in]``, scales and zeros ``[out, groups]`` (the padding past the
    last group dropped); ``named(suffix)`` names a tensor in an error."""
    per_word = 32 // bits
    out_features, in_features = qweight.shape[0], qweight.shape[1] * per_word
    num_groups = -(-in_features // (group_size or in_features))
    for suffix, tensor, dtype, width in (
        ("qweight", qweight, torch.int32, qweight.shape[1]), ("qzeros", qzeros, torch.int32, -(-num_groups // per_word)),
        ("scales", scales, None, num_groups),
    ):
        if tensor.dim() != 2 or tensor.shape[0] != out_features or tensor.shape[1] < width or (dtype is not None and tensor.dtype != dtype):
            raise DamagedCheckpointError(
                f"{named(suffix)} is {tensor.dtype} {tuple(tensor.shape)}, where {bits}-bit AWQ gemv codes of {in_features} features "
                f"in {num_groups} groups give {dtype or 'floats'} [{out_features}, at least {width}]"
            )
    codes = _unpack(qweight, bits, along_rows=False)
    zeros = _unpack(qzeros, bits, along_rows=False)[:, :num_groups].to(torch.int16) + layout.zero_offset
    return codes, scales[:, :num_groups], zeros


def _gemv_fast_codes(qweight, scales, mins, bits: int, group_size: int | None, layout: Layout, named) -> tuple[torch.Tensor, ...]:
    """AWQ gemv_fast's (and llm-awq's) codes ``[out, in]``, scales and mins ``[out, groups]``
    (the padding past the last group dropped); ``named(suffix)`` names a tensor in an error."""
    if qweight.dim() != 2 or scales.dim() != 2 or mins.dim() != 2:
        raise DamagedCheckpointError(f"{named('qweight')} and its scales and zeros are not matrices: {qweight.dim()}, {scales.dim()}, {mins.dim()} dimensions")
    out_features, in_features = qweight.shape[0] * 4, qweight.shape[1]
    num_groups = -(-in_features // (group_size or in_features))
    for suffix, tensor, wanted, ok in (
        ("qweight", qweight, f"int16 [out / 4, in] with whole 64 columns, {in_features} of them", qweight.dtype == torch.int16 and in_features % 64 == 0),
        ("scales", scales, f"floats [at least {num_groups}, {out_features}]", scales.is_floating_point()),
        (layout.zeros_name, mins, f"floats [at least {num_groups}, {out_features}]", mins.is_floating_point()),
    ):
        if not ok or (tensor is not qweight and (tensor.shape[0] < num_groups or tensor.shape[1] != out_features)):
            raise DamagedCheckpointError(f"{named(suffix)} is {tensor.dtype} {tuple(tensor.shape)}, where 4-bit AWQ {layout.version} codes give {wanted}")
    words = qweight.to(torch.int32) & 0xFFFF
    codes = (words.unsqueeze(-1) >> (torch.arange(4, dtype=torch.int32) * 4)) & 0xF  # [out / 4, in, 4]: a word's 4 codes
    rows = codes.reshape(out_features // 4, in_features // 64, 4, 64).permute(0, 2, 1, 3)  # 4 rows of each word's 64 columns
    codes = rows.reshape(out_features, in_features // 32, 32)
    for split, order in reversed(GEMV_FAST_PERMUTATIONS):  # undone: the permuted axes put back
        permuted = [split[axis] for axis in order]
        codes = codes.reshape(out_features, in_features // 32, *permuted).permute(0, 1, *(2 + order.index(axis) for axis in range(3)))
        codes = codes.reshape(out_features, in_features // 32, 32)
    return codes.reshape(out_features, in_features), scales[:num_groups].T, mins[:num_groups].T
