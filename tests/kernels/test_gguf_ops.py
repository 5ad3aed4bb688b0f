"""The GGUF block matmuls (``kernels/csrc/gguf_ops.cpp``): their weights are gguf's own
dequantization bit for bit, and their products equal float matmuls over those weights. Float8
blocks (``F8``, compressed-tensors' FP8 weights kept as they ship) and zero-point blocks
(``Q8Z``, its 8-bit codes with zero points) go through every test the GGUF types do, their
references torch's own ``w.float() * s`` and ``(u - z) * s``."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from duet.kernels import cpu_ops
from duet.kernels.gguf import F8, Q8Z, GGUFWeight, float8_blocks, zero_point_blocks
from tests.gguf_writer import IQ_MAGNITUDES, k_quant_blocks

OPS = cpu_ops.load_gguf()
pytestmark = pytest.mark.skipif(OPS is None, reason="no C++ toolchain")
TYPES = {"Q4_1": gguf.GGMLQuantizationType.Q4_1, "Q8_0": gguf.GGMLQuantizationType.Q8_0, "F8": F8, "Q8Z": Q8Z}


def float8_codes(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random float8 (e4m3fn) weights ``[rows, cols]`` over every code but NaN's (0x7F, 0xFF), the
    first 254 weights each code once: subnormals, both zeros and +-448 included."""
    codes = torch.randint(0, 254, (rows, cols), dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    flat = codes.view(-1)
    count = min(254, flat.numel())
    flat[:count] = torch.arange(count, dtype=torch.int32)
    codes = codes + (codes >= 0x7F).int()  # skip 0x7F; 0xFF is past 253 + 1
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


def quantized(rows: int, cols: int, qtype, seed: int = 0) -> tuple[GGUFWeight, torch.Tensor]:
    """Random weights as GGUF blocks, and gguf's own dequantization of them (float8 blocks:
    torch's ``w.float() * s`` of random codes and scales)."""
    if qtype == F8:
        weights = float8_codes(rows, cols, seed)
        scales = torch.rand(rows, cols // 32, generator=torch.Generator().manual_seed(seed + 1)) * 1e-3 + 1e-5
        return float8_blocks(weights, scales, OPS), weights.float() * scales.repeat_interleave(32, dim=1)
    if qtype == Q8Z:  # (u - z) * s: compressed-tensors' (q - z) * s with q and z offset by 128
        generator = torch.Generator().manual_seed(seed)
        codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=generator)
        zeros = torch.randint(0, 256, (rows, cols // 32), generator=generator).float()
        scales = torch.rand(rows, cols // 32, generator=generator) * 1e-3 + 1e-5
        weights = (codes.float() - zeros.repeat_interleave(32, dim=1)) * scales.repeat_interleave(32, dim=1)
        return zero_point_blocks(codes, scales, zeros, OPS), weights
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.1
    blocks = gguf.quants.quantize(values, qtype)
    dequantized = gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(rows, cols)
    weight = GGUFWeight.from_blocks(torch.from_numpy(np.ascontiguousarray(blocks).reshape(rows, -1)), int(qtype), cols, OPS)
    return weight, torch.from_numpy(dequantized)


@pytest.mark.parametrize("name", TYPES)
def test_the_kernels_weights_are_ggufs_dequantization_bit_for_bit(name):
    weight, reference = quantized(75, 192, TYPES[name])
    assert torch.equal(weight.dequantize(), reference)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 11])
def test_products_equal_float_matmuls_over_the_dequantized_weights(name, rows):
    # 75 outputs: not a multiple of the kernel's 4- or 2-feature tiles; 11 rows: a tile of 8 and one of 3.
    weight, weights = quantized(75, 192, TYPES[name], seed=rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    got = weight.matmul(x)
    expected = (x.double() @ weights.double().T).float()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 17, 21, 40])
def test_panel_products_equal_float_matmuls_over_the_dequantized_weights(name, rows):
    """Many rows may go by panels of dequantized features (from the rows this CPU measured them
    faster, if any; forced here from 1): 96 outputs, three panels of 32 (AVX-512, from the panel
    layout) or six of 16; 21 rows, tiles of rows with a remainder. Tiles of rows and panels read
    the same weights, so their products agree to the rounding of a float sum."""
    weight, weights = quantized(96, 192, TYPES[name], seed=rows)
    weight.lay_out_panels()
    assert (weight.panel_codes is not None) == OPS.panels_need_layout()
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows))
    expected = (x.double() @ weights.double().T).float()
    layout = (weight.panel_codes, weight.panel_scales)
    panels = OPS.gguf_matmul(x, weight.codes, weight.scales, weight.qtype, 1, *layout)
    torch.testing.assert_close(panels, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(OPS.gguf_matmul(x, weight.codes, weight.scales, weight.qtype, cpu_ops.NEVER, *layout), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.matmul(x), expected, rtol=1e-5, atol=1e-5)  # whichever the default picks
    if OPS.panels_need_layout() and rows > 1:  # without its layout an AVX-512 product goes by tiles of rows
        tiles = OPS.gguf_matmul(x, weight.codes, weight.scales, weight.qtype, cpu_ops.NEVER)
        assert torch.equal(OPS.gguf_matmul(x, weight.codes, weight.scales, weight.qtype, 1), tiles)
        assert not torch.equal(panels, tiles)
    if rows >= 17:  # 75 outputs are no whole number of panels: those go by tiles of rows
        odd, odd_weights = quantized(75, 192, TYPES[name], seed=rows)
        odd.lay_out_panels()
        assert odd.panel_codes is None
        torch.testing.assert_close(odd.matmul(x), (x.double() @ odd_weights.double().T).float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [*TYPES, "Q2_K", "Q5_K", "Q6_K"])
def test_the_panel_layout_dequantizes_to_the_same_weights(name):
    """Panels of the panel layout hold exactly the weights the blocks dequantize to: a product of
    one-hot rows from the panels (each output is then one weight times 1, plus zeros) is the
    dequantized weight, bit for bit, for every qtype the kernels read."""
    if not OPS.panels_need_layout():
        pytest.skip("this CPU's panels read the codes themselves")
    if name in ("Q2_K", "Q5_K", "Q6_K"):
        qtype = int(gguf.GGMLQuantizationType[name])
        weight = GGUFWeight.from_blocks(torch.from_numpy(k_quant_blocks(64, 256, qtype, magnitude=0.0001)), qtype, 256, OPS)
    else:
        weight, _ = quantized(64, 256, TYPES[name], seed=3)
    weight.lay_out_panels()
    one_hot = torch.eye(256)
    products = OPS.gguf_matmul(one_hot, weight.codes, weight.scales, weight.qtype, 1, weight.panel_codes, weight.panel_scales)
    assert torch.equal(products.T.contiguous(), weight.dequantize())
    with pytest.raises(RuntimeError, match="do not lay out"):
        OPS.gguf_matmul(one_hot, weight.codes, weight.scales, weight.qtype, 1, weight.panel_codes[:1], weight.panel_scales)


def test_the_process_rule_for_panels_is_the_measured_one_and_every_caller_follows_it():
    """Loading the kernels measures tiles against panels once and sets the rows from which
    panels serve (or never); a product that names no rule, through pybind or the torch operator
    the decoder stack calls, follows the process's: bit for bit the product of the way it names."""
    assert OPS.panel_min_rows() in (*cpu_ops.PANEL_ROWS, cpu_ops.NEVER)
    weight, _ = quantized(96, 192, TYPES["Q4_1"], seed=7)
    weight.lay_out_panels()
    layout = (weight.panel_codes, weight.panel_scales)
    x = torch.randn(24, 192, generator=torch.Generator().manual_seed(7))
    measured = OPS.panel_min_rows()
    try:
        for rule in (1, cpu_ops.NEVER):
            OPS.set_panel_min_rows(rule)
            forced = OPS.gguf_matmul(x, weight.codes, weight.scales, weight.qtype, rule, *layout)
            assert torch.equal(OPS.gguf_matmul(x, weight.codes, weight.scales, weight.qtype, -1, *layout), forced)
            assert torch.equal(weight.matmul(x), forced)
            assert torch.equal(torch.ops.duet_gguf.matmul(x, weight.codes, weight.scales, weight.qtype, -1, *layout), forced)
            assert torch.equal(torch.ops.duet_gguf.matmul(x, weight.codes, weight.scales, weight.qtype, rule, *layout), forced)
        assert not torch.equal(OPS.gguf_matmul(x, weight.codes, weight.scales, weight.qtype, 1, *layout), forced)  # two ways, really
    finally:
        OPS.set_panel_min_rows(measured)
    with pytest.raises(RuntimeError, match="at least 1"):
        OPS.set_panel_min_rows(0)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S"])
def test_k_quants_are_rewritten_to_kernel_blocks_that_dequantize_bit_for_bit(name):
    """Q4_K becomes Q4_1 blocks (scale d * sc, min -dmin * m), Q5_K blocks of a byte a code with
    the same scale and min, Q6_K and Q3_K int8 blocks with a scale per 16, Q2_K blocks of a byte
    a code with a scale and min per 16, IQ4_NL and IQ4_XS int8 blocks of their table's values
    (Q8_0) with a scale per 32, the 1- to 3-bit i-quants int8 blocks of their grids' signed
    values with a scale per 32 (Q8_0) or per 16 (IQ2_XS, IQ2_S: Q6_K's kernel blocks): each
    dequantizes to gguf's own floats exactly, and multiplies as float matmuls over them."""
    qtype = getattr(gguf.GGMLQuantizationType, name)
    magnitude = ({"Q2_K": 0.002, "Q4_K": 0.002} | IQ_MAGNITUDES).get(name, 0.0001)
    blocks = k_quant_blocks(48, 512, int(qtype), magnitude=magnitude)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(48, 512))
    weight = GGUFWeight.from_blocks(torch.from_numpy(blocks), int(qtype), 512, OPS)
    by_16 = {"IQ2_XS": 14, "IQ2_S": 14}
    assert weight.qtype == ({"Q2_K": 10, "Q3_K": 14, "Q4_K": 3, "Q5_K": 13, "Q6_K": 14} | by_16).get(name, 8)
    assert reference.abs().max() > 0 and len(reference.unique()) > 1000  # values of the whole table, at many scales
    assert torch.equal(weight.dequantize(), reference)
    for rows in (1, 3, 20):  # tiles of rows, and panels
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(weight.matmul(x), (x.double() @ reference.double().T).float(), rtol=1e-5, atol=1e-5)
    if OPS.has_bf16():  # bf16 rows read the same weights rounded to bf16, by tiles and by panels
        one_hot = torch.eye(512, dtype=torch.bfloat16)[:40]
        weight.lay_out_panels()
        layouts = [(cpu_ops.NEVER,)] + ([(1, weight.panel_codes, weight.panel_scales)] if weight.panel_codes is not None else [])
        for way in layouts:
            products = OPS.gguf_matmul_bf16(one_hot, weight.codes, weight.scales, weight.qtype, *way)
            assert torch.equal(products, reference.to(torch.bfloat16).float()[:, :40].T)
    shard = weight.shard([slice(5, 20)], slice(256, 512))
    assert torch.equal(shard.dequantize(), reference[5:20, 256:])
    with pytest.raises(ValueError, match="do not hold rows of 500"):
        GGUFWeight.from_blocks(torch.from_numpy(blocks), int(qtype), 500, OPS)


@pytest.mark.parametrize(("name", "kernel_type"), [("Q4_0", 3), ("Q5_0", 13), ("Q5_1", 13)])
def test_blocks_without_kernels_of_their_own_are_rewritten_to_blocks_that_dequantize_bit_for_bit(name, kernel_type):
    """A Q4_0 block's ``d * (q - 8)`` is a Q4_1 block's ``d * q + m`` with ``m = -8 d``, exactly;
    Q5_0's ``d * (q - 16)`` and Q5_1's ``d * q + m`` are the kernels' Q5_K blocks (a byte a code),
    their fifth bits gathered from the block's word of them."""
    qtype = gguf.GGMLQuantizationType[name]
    rows = torch.randn(40, 256, generator=torch.Generator().manual_seed(4)).numpy()
    blocks = gguf.quants.quantize(rows, qtype)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, qtype).astype(np.float32).reshape(40, 256))
    weight = GGUFWeight.from_blocks(torch.from_numpy(blocks), int(qtype), 256, OPS)
    assert weight.qtype == kernel_type
    assert torch.equal(weight.dequantize(), reference)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(weight.matmul(x), (x.double() @ reference.double().T).float(), rtol=1e-5, atol=1e-5)


def test_malformed_weights_are_refused_with_a_reason():
    weight, _ = quantized(4, 64, TYPES["Q4_1"])
    with pytest.raises(RuntimeError, match="do not hold"):
        weight.matmul(torch.randn(1, 96))
    with pytest.raises(RuntimeError, match="not supported"):
        OPS.gguf_matmul(torch.randn(1, 64), weight.codes, weight.scales, 2)
    with pytest.raises(ValueError, match="do not hold rows of 96"):
        GGUFWeight.from_blocks(torch.zeros(4, 40, dtype=torch.uint8), int(TYPES["Q4_1"]), 96, OPS)
    with pytest.raises(ValueError, match="a scale a block"):
        float8_blocks(float8_codes(4, 64, seed=0), torch.ones(4, 1), OPS)


@pytest.mark.parametrize("name", TYPES)
def test_a_shard_of_rows_and_block_columns_is_that_slice_of_the_weight(name):
    """Guards tensor-parallel shards of GGUF weights: q/k/v row ranges concatenated, and input
    features cut on block boundaries, dequantize to exactly that slice of the float weight."""
    weight, reference = quantized(75, 192, TYPES[name])
    rows = [slice(3, 10), slice(40, 41), slice(60, 75)]
    shard = weight.shard(rows, slice(64, 160))
    assert torch.equal(shard.dequantize(), torch.cat([reference[part] for part in rows])[:, 64:160])
    assert torch.equal(weight.shard([slice(None)]).dequantize(), reference)
    with pytest.raises(ValueError, match="block boundaries"):
        weight.shard([slice(None)], slice(0, 48))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 17, 40])
@pytest.mark.parametrize("outputs", [4160, 1099])
@pytest.mark.parametrize("panels", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_greedy_tokens_are_the_argmax_of_the_products(name, rows, outputs, panels, dtype):
    """The LM head's fused argmax is torch.argmax of gguf_matmul's own products (the unfused
    sampler's greedy tokens) with each row's excluded ids at -inf: 4160 outputs are three
    groups of 2,048 features (AVX-512) or five of 1,024, by panels where the rows reach the
    process's rule (with the panel layout, on AVX-512) and by tiles of rows without it; 1099 no
    whole number of panels (tiles of rows). bf16 rows (a bf16 model's) take the argmax of their
    products rounded to bf16, as the unfused path's. Each row's best feature is copied into
    another group: of two equal bests the first must win, and with the first excluded, its copy."""
    if dtype == torch.bfloat16 and not OPS.has_bf16():
        pytest.skip("no AVX512_BF16")
    weight, _ = quantized(outputs, 192, TYPES[name], seed=rows)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(dtype)
    best = weight.matmul(x).argmax(dim=-1)
    codes, scales = weight.codes.clone(), weight.scales.clone()
    copies = (best + 2048) % outputs
    codes[copies], scales[copies] = codes[best], scales[best]
    weight = GGUFWeight(codes, scales, weight.qtype, 192, OPS)
    if panels:
        weight.lay_out_panels()
    products = weight.matmul(x).float()
    tied = products.gather(1, copies[:, None]) == products.gather(1, best[:, None])
    assert tied.sum() >= (rows + 1) // 2  # all but rows whose best another row's copy overwrote
    none = torch.empty(rows, 0, dtype=torch.long)
    assert torch.equal(weight.matmul_argmax(x, none), products.argmax(dim=-1))
    excluded = torch.full((rows, 2), -1, dtype=torch.long)
    excluded[:, 0] = products.argmax(dim=-1)
    excluded[0, 1] = outputs - 1
    masked = products.index_put((torch.arange(rows), excluded[:, 0]), torch.tensor(float("-inf")))
    masked[0, outputs - 1] = float("-inf")
    assert torch.equal(weight.matmul_argmax(x, excluded), masked.argmax(dim=-1))


def test_fused_greedy_tokens_rank_nan_first_as_torch_does():
    weight, _ = quantized(1100, 64, TYPES["Q8_0"])
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")  # row 1's products are all NaN: the first of them wins
    none = torch.empty(3, 0, dtype=torch.long)
    assert torch.equal(weight.matmul_argmax(x, none), weight.matmul(x).argmax(dim=-1))
    assert weight.matmul_argmax(x, none)[1] == 0


@pytest.mark.skipif(OPS is None or not OPS.has_bf16(), reason="no AVX512_BF16")
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 21])
@pytest.mark.parametrize("panels", [False, True])
def test_bf16_products_use_the_weights_rounded_to_bf16_as_torch_rounds_them(name, rows, panels):
    """bf16 rows (a bf16 model's) multiply the blocks' weights rounded to bf16 exactly as
    ``.to(torch.bfloat16)`` rounds the fp32 weights, by tiles of rows (21 rows: tiles of 8 and a
    remainder) or by panels of bf16 pairs from the panel layout (forced from one row): one-hot
    rows read single weights back bit for bit; random rows equal a float product over those
    bf16 weights."""
    weight, weights = quantized(96, 192, TYPES[name], seed=rows)
    way = (cpu_ops.NEVER,)
    if panels:
        weight.lay_out_panels()
        if weight.panel_codes is None:
            pytest.skip("this CPU's bf16 products go by tiles of rows alone")
        way = (1, weight.panel_codes, weight.panel_scales)
    rounded = weights.to(torch.bfloat16)
    columns = torch.arange(rows) * 7 % 192
    one_hot = torch.zeros(rows, 192, dtype=torch.bfloat16)
    one_hot[torch.arange(rows), columns] = 1.0
    assert torch.equal(OPS.gguf_matmul_bf16(one_hot, weight.codes, weight.scales, weight.qtype, *way), rounded.float()[:, columns].T)
    x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    expected = (x.double() @ rounded.double().T).float()
    torch.testing.assert_close(OPS.gguf_matmul_bf16(x, weight.codes, weight.scales, weight.qtype, *way), expected, rtol=1e-5, atol=1e-5)
    got = weight.matmul(x)  # by the process's rule
    assert got.dtype == torch.bfloat16
    rule = (-1, weight.panel_codes, weight.panel_scales)
    assert torch.equal(got, OPS.gguf_matmul_bf16(x, weight.codes, weight.scales, weight.qtype, *rule).to(torch.bfloat16))
    # the decoder stack's operator rounds in the call, as .to(torch.bfloat16) does (40 features: a
    # remainder past its vectors of 16)
    assert torch.equal(torch.ops.duet_gguf.matmul_bf16(x, weight.codes, weight.scales, weight.qtype, *rule), got)
    odd, _ = quantized(40, 192, TYPES[name], seed=rows)
    assert torch.equal(torch.ops.duet_gguf.matmul_bf16(x, odd.codes, odd.scales, odd.qtype, -1, None, None), odd.matmul(x))


@pytest.mark.skipif(OPS is None or not OPS.has_amx(), reason="no AMX-BF16 tiles on this CPU (or in this build)")
@pytest.mark.parametrize("name", [*TYPES, "Q2_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 40, 64])
def test_amx_tiles_multiply_the_panels_bf16_weights_under_the_process_rule_alone(name, rows):
    """On AMX, bf16 panels multiply by tiles of up to 16 rows, two at a time (17: 16 and 1; 33:
    17 then 16, the tiles configured again between; 40: 20 and 20; 64: 32 and 32), each panel of
    a thread's several dequantized while the tiles multiply the one before: one-hot rows read
    the weights rounded to bf16 back bit for bit, random rows equal a float product over them; a
    product given a rule of its own (batch_invariant's) keeps vdpbf16ps whatever the process's
    AMX rule."""
    if name in ("Q2_K", "Q5_K", "Q6_K"):
        qtype = int(gguf.GGMLQuantizationType[name])
        weight = GGUFWeight.from_blocks(torch.from_numpy(k_quant_blocks(320, 256, qtype, magnitude=0.0001)), qtype, 256, OPS)
        weights = weight.dequantize()
    else:
        weight, weights = quantized(320, 256, TYPES[name], seed=rows)  # 10 panels of 32 features
    weight.lay_out_panels()
    layout = (weight.panel_codes, weight.panel_scales)
    rounded = weights.to(torch.bfloat16)
    columns = torch.arange(rows) * 7 % 256
    one_hot = torch.zeros(rows, 256, dtype=torch.bfloat16)
    one_hot[torch.arange(rows), columns] = 1.0
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    before = OPS.bf16_amx_min_rows()
    try:
        OPS.set_bf16_amx_min_rows(cpu_ops.NEVER)
        alone = OPS.gguf_matmul_bf16(x, weight.codes, weight.scales, weight.qtype, 1, *layout)
        OPS.set_bf16_amx_min_rows(1)
        read_back = OPS.gguf_matmul_bf16(one_hot, weight.codes, weight.scales, weight.qtype, -1, *layout)
        assert torch.equal(read_back, rounded.float()[:, columns].T)
        tiles = OPS.gguf_matmul_bf16(x, weight.codes, weight.scales, weight.qtype, -1, *layout)
        torch.testing.assert_close(tiles, (x.double() @ rounded.double().T).float(), rtol=1e-5, atol=1e-5)
        assert torch.equal(OPS.gguf_matmul_bf16(x, weight.codes, weight.scales, weight.qtype, 1, *layout), alone)
        excluded = torch.zeros(rows, 0, dtype=torch.int64)
        greedy = OPS.gguf_matmul_argmax(x, weight.codes, weight.scales, weight.qtype, excluded, -1, *layout)
        assert torch.equal(greedy, tiles.to(torch.bfloat16).float().argmax(dim=1))
    finally:
        OPS.set_bf16_amx_min_rows(before)
