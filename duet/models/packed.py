"""Checkpoints whose linear weights ship quantized (llm-compressor's compressed-tensors
``pack-quantized``: W4A16 and W8A16; ``int-quantized``: W8A8, and W8A16 so written; GPTQ's and
AWQ's formats, read by ``duet.models.gptq``),
kept in their packed form and computed by duet's block kernels (``kernels.gguf``), never
dequantized to a resident float copy.

compressed-tensors packs a weight's signed ``num_bits`` codes ``q``, offset to unsigned
``u = q + 2^(bits-1)``, densely into int32 words along the input features (code ``i`` of each
32 at bits ``bits * i``), beside a scale ``s`` per group of ``group_size`` input features (or
per output channel); its weight is ``q * s``. Each group of a multiple of 32 features becomes
32-weight blocks of the kernels' own layouts, exactly:

- 4 bits: Q4_1 blocks of codes ``u`` (0..15) with scale ``d = s`` and min ``m = -8 s`` (exact:
  a power of two times ``s``); the kernels' fused ``d * u + m`` rounds ``s * (u - 8) = q * s``
  once, as compressed-tensors' own ``q * s`` does.
- 8 bits: Q8_0 blocks of codes ``q`` (int8) with scale ``s``: ``q * s``, rounded once.
- 4 bits with a zero point ``z`` per group (asymmetric: AWQ's scheme, ``W4A16_ASYM``): its
  weight is ``(q - z) * s``, and ``q - z`` (-15..15) is an int8 code: Q8_0 blocks of those codes
  with scale ``s``, rounded once as compressed-tensors' own is. (A Q4_1 min ``-(8 + z) s`` would
  round where the weight does not.) A byte a code, not half: 1.125 bytes a weight resident.

``int-quantized`` ships each weight's int8 codes ``q`` unpacked (the tensor ``x.weight`` itself,
int8) beside its scales: Q8_0 blocks as above. W8A8 quantizes each product's input too, per
token and at run time (``input_activations``: int8, ``token``, dynamic, symmetric): its rows
become ``round(x / s) * s`` clamped to the int8 codes, ``s`` the row's largest magnitude over
127.5, exactly as compressed-tensors' own forward does (``kernels.w8a8.dynamic_per_token``), and the
product is then computed from them as from any input.

Static schemes (``dynamic: false``, ``strategy: tensor``: FP8's and static W8A8's) quantize each
input at the checkpoint's calibrated ``input_scale`` (and ``input_zero_point``, int8) instead
(``duet.models.input_schemes``, ``kernels.w8a8.StaticInput``).

``float-quantized`` (FP8 W8A8, llm-compressor's FP8_DYNAMIC) ships float8 (e4m3fn) weights with a
scale per channel or per tensor, and quantizes inputs per token to float8 likewise (the scale
the row's largest magnitude over 448). Its weights are kept as they ship, the kernels' float8
blocks (``duet.models.float8``, which reads Hugging Face's own ``quant_method: fp8`` too): 1.125
bytes a weight resident.

8-bit codes with a zero point per group or channel (``W8A16`` or ``W8A8`` with
``symmetric: false``, either format) have ``q - z`` spanning 9 bits, which no int8 block holds,
and a Q8_1-like ``d u + m`` would round where compressed-tensors does not: they are the
kernels' Q8Z blocks (``kernels.gguf.zero_point_blocks``), codes ``u = q + 128`` with the scale
and ``z + 128`` beside each block, ``(u - (z + 128)) * s`` rounded once as compressed-tensors'
``(q - z) * s``: 1.25 bytes a weight resident (a fused product's symmetric parts take the zero
point 128).

Groups of a multiple of 32 features or whole channels, and no activation schemes but W8A8's
(dynamic per token, or static per tensor): each other is refused at load, naming the field.
Activation ordering ``weight`` (or ``static``) leaves the groups in order and the format as it
is; ``group`` (or ``dynamic``: features in groups out of order, a ``weight_g_idx`` per weight,
which compressed-tensors wrote up to 0.18) is read, in the ``pack-quantized`` and
``int-quantized`` formats, as GPTQ's activation order is (``duet.models.gptq``): the codes with
their input features sorted by group, and the Linear takes its input in that order (W8A8's
inputs are quantized per token or per tensor, at a scale no order of the features changes).

Scales in the checkpoint's dtype widen to fp32 exactly; a checkpoint whose scales are bf16
dequantizes, in compressed-tensors' own code, to ``q * s`` rounded to bf16: a bf16 model
computes on those very weights, an fp32 one on ``q * s`` unrounded (float8 weights alike).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from duet.errors import DamagedCheckpointError, UnsupportedCheckpointError
from duet.kernels.gguf import BLOCK, Q4_1, Q8_0, GGUFWeight, q4_1_words, zero_point_blocks
from duet.kernels.w8a8 import FLOAT8_PER_TOKEN, FLOAT8_STATIC, INT8_PER_TOKEN, INT8_STATIC
from duet.models import float8
from duet.models.gptq import Layout, WeightCodes, input_order, layout_codes, read_layout, tensor_name

FORMATS = ("pack-quantized", "int-quantized", "float-quantized")
ACTORDERS = ("weight", "static", "group", "dynamic")  # 'static' is 'weight' and 'dynamic' 'group' (compressed-tensors' aliases)


@dataclasses.dataclass(frozen=True)
class PackedScheme:
    """One checkpoint's weight quantization, as its ``quantization_config`` says."""

    num_bits: int
    group_size: int | None  # None: a scale per output channel
    symmetric: bool = True  # False: a zero point per group too; GPTQ, AWQ: each weight's zeros say
    layout: Layout | None = None  # a GPTQ or AWQ checkpoint's (None: compressed-tensors)
    format: str = "pack-quantized"  # compressed-tensors': codes packed in int32 words, int8 or float8 as they are; "fp8": transformers'
    float8_block: tuple[int, int] | None = None  # "fp8": the rows and input features a scale covers (None: the tensor)
    activations: str | None = None  # how each product's input is quantized first (INT8_PER_TOKEN, INT8_STATIC, ...); None: not
    group_order: bool = False  # compressed-tensors' ``actorder: group``: a ``weight_g_idx`` per weight

    def ships_codes(self, state: dict[str, torch.Tensor], part: str) -> bool:
        """Whether the checkpoint holds ``part``'s codes for the block kernels (an ``int-quantized``
        one: as int8; a ``float-quantized`` one: as float8)."""
        name = self.packed_name(part)
        if name not in state:
            return False
        wanted = {"int-quantized": torch.int8, float8.COMPRESSED_TENSORS: torch.float8_e4m3fn, float8.HUGGING_FACE: torch.float8_e4m3fn}.get(self.format)
        return wanted is None or state[name].dtype == wanted

    def packed_name(self, part: str) -> str:
        """The tensor that holds ``part``'s (``x.weight``) codes."""
        if self.layout is not None:
            return tensor_name(part, "qweight")
        return part if self.format in ("int-quantized", float8.COMPRESSED_TENSORS, float8.HUGGING_FACE) else part + "_packed"


def read_scheme(path: Path) -> PackedScheme | None:
    """The checkpoint's packed scheme from ``config.json``'s ``quantization_config`` (None for a
    float checkpoint); a scheme duet does not compute exactly is refused, naming the field."""
    config = json.loads((path / "config.json").read_text()).get("quantization_config")
    if config is None:
        return None

    def refuse(field: str, value, wanted: str):
        raise UnsupportedCheckpointError(f"{path}: quantization_config's {field}={value!r} is not supported: duet reads {wanted}")

    method = config.get("quant_method")
    if method in ("gptq", "awq"):
        bits, group_size, layout = read_layout(config, path, refuse)
        return PackedScheme(bits, group_size, symmetric=False, layout=layout)
    if method == float8.HUGGING_FACE:
        return PackedScheme(8, None, format=float8.HUGGING_FACE, float8_block=float8.hugging_face_block(config, refuse))
    if method != "compressed-tensors":
        refuse("quant_method", method, "'compressed-tensors', 'gptq', 'awq' or 'fp8' checkpoints")
    groups = config.get("config_groups") or {}
    if not groups:
        refuse("config_groups", groups, "one group of quantized weights")
    weights = [group.get("weights") for group in groups.values()]
    if any(weight != weights[0] for weight in weights):
        refuse("config_groups", sorted(groups), "one weight scheme for every group")
    formats = {group.get("format") or config.get("format") for group in groups.values()}
    activations = [group.get("input_activations") for group in groups.values()]
    inputs = None  # the groups' one activation scheme (``_check_activations``), None: weight-only
    for name, group in groups.items():
        group_format = group.get("format") or config.get("format")
        if group_format not in FORMATS or len(formats) > 1:
            refuse(f"config_groups.{name}.format", group_format, f"one of {', '.join(FORMATS)} for every group")
        if group.get("output_activations") is not None:
            refuse(f"config_groups.{name}.output_activations", "...", "none")
        group_inputs = group.get("input_activations")
        if group_inputs != activations[0]:
            refuse(f"config_groups.{name}.input_activations", "..." if group_inputs else group_inputs, "one activation scheme for every group")
        if group_inputs is not None:
            inputs = _check_activations(group_inputs, group_format, f"config_groups.{name}.input_activations", refuse)
    args = weights[0] or {}
    if formats == {"float-quantized"}:
        float8.check_compressed_tensors(args, refuse)
        return PackedScheme(8, None, format=float8.COMPRESSED_TENSORS, activations=inputs)
    checks = (
        ("type", args.get("type"), args.get("type") == "int", "'int'"),
        ("num_bits", args.get("num_bits"), args.get("num_bits") in (4, 8), "4 or 8"),
        ("symmetric", args.get("symmetric"), args.get("symmetric") in (None, True, False), "true or false"),
        ("strategy", args.get("strategy"), args.get("strategy") in ("group", "channel"), "'group' or 'channel'"),
        # 'weight' (alias 'static', llm-compressor's default): GPTQ visits the features in the
        # activations' order, but groups stay in order, so the format is as without it.
        ("actorder", args.get("actorder"), args.get("actorder") in (None, False, *ACTORDERS), "none, " + ", ".join(map(repr, ACTORDERS))),
        ("dynamic", args.get("dynamic"), not args.get("dynamic"), "false"),
    )
    for field, value, ok, wanted in checks:
        if not ok:
            refuse(f"weights.{field}", value, wanted)
    group_size = args.get("group_size") if args.get("strategy") == "group" else None
    if group_size is not None and (group_size <= 0 or group_size % BLOCK):
        refuse("weights.group_size", group_size, f"a multiple of {BLOCK}")
    if formats == {"int-quantized"} and args["num_bits"] != 8:
        refuse("weights.num_bits", args["num_bits"], "8 in the int-quantized format")
    group_order = args.get("actorder") in ("group", "dynamic") and group_size is not None
    return PackedScheme(
        args["num_bits"], group_size, args.get("symmetric") is not False, format=formats.pop(), activations=inputs, group_order=group_order,
    )


def _check_activations(args: dict, group_format: str, field: str, refuse) -> str:
    """W8A8's input scheme (int8, or float8 for FP8 weights): per token and dynamic, symmetric
    (``INT8_PER_TOKEN``, ``FLOAT8_PER_TOKEN``), or one calibrated scale a tensor, static, with a
    zero point too for int8 where asymmetric (``INT8_STATIC``, ``FLOAT8_STATIC``)."""
    if group_format == "pack-quantized":
        refuse(field, "...", "weight-only schemes in the pack-quantized format (W4A16, W8A16)")
    kind = "int" if group_format == "int-quantized" else "float"
    static = args.get("dynamic") is False and args.get("strategy") == "tensor"
    checks = (("type", kind), ("num_bits", 8)) + (
        (("strategy", "tensor"), ("dynamic", False)) if static else (("strategy", "token"), ("dynamic", True), ("symmetric", True))
    )
    for key, wanted in checks:
        if args.get(key) != wanted:
            refuse(f"{field}.{key}", args.get(key), repr(wanted).lower() + f" (W8A8: {kind}8 per token, dynamic, symmetric; or per tensor, static)")
    if static and kind == "float" and args.get("symmetric") is False:
        refuse(f"{field}.symmetric", False, "true for float8 inputs")
    if static:
        return INT8_STATIC if kind == "int" else FLOAT8_STATIC
    return INT8_PER_TOKEN if kind == "int" else FLOAT8_PER_TOKEN


def is_packed(state: dict[str, torch.Tensor], parts: list[str], scheme: PackedScheme) -> bool:
    """Whether the Hugging Face weights ``parts`` (``x.weight``) ship packed; all or none must."""
    packed = [scheme.ships_codes(state, part) for part in parts]
    if any(packed) and not all(packed):
        raise DamagedCheckpointError(f"of {', '.join(parts)}, only some ship packed: they are computed as one product")
    return packed[0]


def _codes(state: dict[str, torch.Tensor], part: str, scheme: PackedScheme, path: Path) -> WeightCodes:
    """A packed weight's unsigned codes ``[out, in]`` (uint8; 4 bits asymmetric: ``q - z``, int8)
    and scales per 32-weight block (``WeightCodes``); for 8 bits with zero points, each block's
    zero point offset as the codes are (``z + 128``)."""
    if scheme.layout is not None:
        return layout_codes(state, part, scheme.num_bits, scheme.group_size, scheme.layout, path)
    if scheme.format == "int-quantized":
        return _int8_codes(state, part, scheme, path)
    codes = _unpacked_codes(state, part, scheme, path)
    out_features, in_features = codes.shape
    scale = _group_scales(state, part, scheme, codes.shape, path).float()
    group = scheme.group_size or in_features
    order = _group_order(state, part, scheme, in_features, path)
    if order is not None:  # the input features sorted by group: each group's features side by side
        codes = codes[:, order]
    block_scales = scale.repeat_interleave(group // BLOCK, dim=1)
    if scheme.symmetric:
        return WeightCodes(codes.to(torch.uint8), block_scales, True, order)
    zero = _zero_points(state[part + "_zero_point"], scheme.num_bits, out_features, in_features // group, part, path)
    if scheme.num_bits == 8:  # u = q + 128 beside z + 128
        return WeightCodes(codes.to(torch.uint8), block_scales, False, order, (zero + 128).float().repeat_interleave(group // BLOCK, dim=1))
    signed = codes.to(torch.int16) - 8 - zero.repeat_interleave(group, dim=1)  # q - z, in -15..15
    return WeightCodes(signed.to(torch.int8), block_scales, False, order)


def _group_order(state: dict[str, torch.Tensor], part: str, scheme: PackedScheme, in_features: int, path: Path) -> torch.Tensor | None:
    """Where the scheme groups input features out of order (``actorder: group``), the features
    sorted by their group (``input_order``); None: in order."""
    if not scheme.group_order:
        return None
    name = part + "_g_idx"
    if name not in state:
        raise DamagedCheckpointError(f"{path}: tensor {name} is missing (actorder: group gives each weight one)")
    return input_order(state[name], name, torch.arange(in_features) // scheme.group_size, path)


def _unpacked_codes(state: dict[str, torch.Tensor], part: str, scheme: PackedScheme, path: Path) -> torch.Tensor:
    """A ``pack-quantized`` weight's unsigned codes ``u = q + 2^(bits-1)``, ``[out, in]`` (int32),
    after checking that its tensors are all there and whole blocks."""
    for suffix in ("_packed", "_scale") + (() if scheme.symmetric else ("_zero_point",)):
        if part + suffix not in state:
            raise DamagedCheckpointError(f"{path}: tensor {part}{suffix} is missing")
    packed = state[part + "_packed"]
    shape = state.get(part + "_shape")
    out_features = packed.shape[0]
    in_features = int(shape[1]) if shape is not None else packed.shape[1] * 32 // scheme.num_bits
    if packed.dtype != torch.int32 or packed.shape[1] * 32 != in_features * scheme.num_bits:
        raise DamagedCheckpointError(
            f"{path}: {part}_packed is {packed.dtype} {tuple(packed.shape)}, not {scheme.num_bits}-bit codes of {in_features} features in int32 words"
        )
    if in_features % BLOCK:
        raise UnsupportedCheckpointError(f"{path}: {part} has {in_features} input features, not a multiple of {BLOCK}")
    per_word = 32 // scheme.num_bits
    shifts = torch.arange(per_word, dtype=torch.int32) * scheme.num_bits
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << scheme.num_bits) - 1)).reshape(out_features, in_features)


def _group_scales(state: dict[str, torch.Tensor], part: str, scheme: PackedScheme, shape, path: Path) -> torch.Tensor:
    """``part``'s scales ``[out, groups]`` as the checkpoint has them, their shape checked against ``shape``'s."""
    out_features, in_features = shape
    scale = state[part + "_scale"]
    groups = in_features // (scheme.group_size or in_features)
    if scale.shape != (out_features, groups):
        raise DamagedCheckpointError(f"{path}: {part}_scale has shape {tuple(scale.shape)} where the scheme gives {(out_features, groups)}")
    return scale


def _int8_codes(state: dict[str, torch.Tensor], part: str, scheme: PackedScheme, path: Path):
    """``_codes`` of an ``int-quantized`` weight: its int8 codes ``q`` offset to ``u = q + 128``
    (with zero points: theirs likewise, int8 beside the scales)."""
    if part + "_scale" not in state:
        raise DamagedCheckpointError(f"{path}: tensor {part}_scale is missing")
    codes = state[part]
    out_features, in_features = codes.shape
    if in_features % BLOCK:
        raise UnsupportedCheckpointError(f"{path}: {part} has {in_features} input features, not a multiple of {BLOCK}")
    scale = _group_scales(state, part, scheme, codes.shape, path).float()
    group = scheme.group_size or in_features
    unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
    order = _group_order(state, part, scheme, in_features, path)
    if order is not None:  # the input features sorted by group, as in the pack-quantized format
        unsigned = unsigned[:, order]
    block_scales = scale.repeat_interleave(group // BLOCK, dim=1)
    if scheme.symmetric:
        return WeightCodes(unsigned, block_scales, True, order)
    zero = state.get(part + "_zero_point")
    if zero is None or zero.dtype != torch.int8 or zero.shape != scale.shape:
        found = "missing" if zero is None else f"{zero.dtype} {tuple(zero.shape)}"
        raise DamagedCheckpointError(f"{path}: {part}_zero_point is {found}, not int8 zero points beside its scales")
    return WeightCodes(unsigned, block_scales, False, order, zeros=(zero.float() + 128).repeat_interleave(group // BLOCK, dim=1))


def _zero_points(packed: torch.Tensor, bits: int, out_features: int, num_groups: int, part: str, path: Path) -> torch.Tensor:
    """``bits``-bit zero points ``[out, groups]`` (signed, as the codes are, int16), which
    compressed-tensors packs along the output features: word ``w`` of a group holds features
    ``n w .. n w + n - 1``, ``n = 32 / bits``."""
    per_word = 32 // bits
    num_words = -(-out_features // per_word)
    if packed.dtype != torch.int32 or packed.shape != (num_words, num_groups):
        raise DamagedCheckpointError(
            f"{path}: {part}_zero_point is {packed.dtype} {tuple(packed.shape)}, not {bits}-bit zero points of {out_features} features "
            f"packed in int32 words {(num_words, num_groups)}"
        )
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    unsigned = (packed.T.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [groups, words, per_word]
    return unsigned.reshape(num_groups, -1)[:, :out_features].T.to(torch.int16) - (1 << (bits - 1))


def packed_weight(
    state: dict[str, torch.Tensor], parts: list[str], scheme: PackedScheme, path: Path, ops
) -> tuple[GGUFWeight, torch.Tensor | None]:
    """The weight made of ``parts``' rows (a fused q/k/v or gate/up product), as blocks for ``ops``:
    float8 blocks of float8 weights; Q8Z blocks of 8-bit codes where a part's have zero points;
    Q4_1 blocks of codes with mins (AWQ gemv_fast's); of symmetric codes where every part's are,
    else of ``q - z`` (a symmetric part's ``u - 8``); and the order the blocks take their input
    features in (``Linear.input_order``), which the parts share (they read one input)."""
    if scheme.format in (float8.COMPRESSED_TENSORS, float8.HUGGING_FACE):
        return float8.float8_weight(state, parts, scheme, path, ops), None
    weights = [_codes(state, part, scheme, path) for part in parts]
    first = weights[0].order
    if any((w.order is None) != (first is None) or (w.order is not None and not torch.equal(w.order, first)) for w in weights):
        raise UnsupportedCheckpointError(f"{path}: {', '.join(parts)} order their input features differently, and are computed as one product")
    if any(w.zeros is not None for w in weights):  # 8 bits with zero points: Q8Z blocks (a symmetric part's zero is 128)
        zeros = [torch.full_like(w.scales, 128.0) if w.zeros is None else w.zeros for w in weights]
        return zero_point_blocks(torch.cat([w.codes for w in weights]), torch.cat([w.scales for w in weights]), torch.cat(zeros), ops), first
    return _blocks(weights, scheme, ops), first


def _blocks(weights: list[WeightCodes], scheme: PackedScheme, ops) -> GGUFWeight:
    """The parts' codes and scales (``_codes``), their rows concatenated, as blocks."""
    if any(w.mins is not None for w in weights):  # one checkpoint's: every part has its mins
        codes, scales, mins = (torch.cat([getattr(w, field) for w in weights]) for field in ("codes", "scales", "mins"))
        return _q4_1(codes, scales, mins, ops)
    symmetric = all(w.symmetric for w in weights)
    codes = [w.codes if symmetric or not w.symmetric else (w.codes.to(torch.int16) - 8).to(torch.int8) for w in weights]
    codes, scales = torch.cat(codes), torch.cat([w.scales for w in weights])
    out_features, in_features = codes.shape
    if not symmetric:  # q - z as int8 codes, Q8_0 blocks
        blocks = codes.view(torch.uint8).reshape(out_features, -1).contiguous()
        return GGUFWeight(blocks, scales.contiguous(), Q8_0, in_features, ops)
    if scheme.num_bits == 4:
        return _q4_1(codes, scales, -8.0 * scales, ops)
    signed = (codes.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
    return GGUFWeight(signed.reshape(out_features, -1).contiguous(), scales.contiguous(), Q8_0, in_features, ops)


def _q4_1(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, ops) -> GGUFWeight:
    """Q4_1 blocks of 4-bit codes ``[out, in]`` (0..15), each 32's weight ``scale * code + min``."""
    out_features, in_features = codes.shape
    blocks = codes.view(out_features, in_features // BLOCK, BLOCK)
    words = q4_1_words(blocks[..., :16] | (blocks[..., 16:] << 4))  # Q4_1's byte order: weight j low, 16 + j high
    block_scales = torch.stack([scales, mins], dim=-1).reshape(out_features, -1).contiguous()
    return GGUFWeight(words.reshape(out_features, -1).contiguous(), block_scales, Q4_1, in_features, ops)
