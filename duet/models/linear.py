"""Linear layer without bias, with CPU fast paths for the small row counts of decode steps.

On CPU, oneDNN with a weight reordered once into its blocked layout runs the
``[rows, in] x [in, out]`` products of decode steps (2 to ~128 rows) faster than ``F.linear``.
Both are kept, and each call picks by rows; whether oneDNN also serves one row, and rows past
128, depends on the CPU and is measured once per machine (``linear_rules``; figures in
docs/benchmarks.md, "GGUF products and the measured rules").

A weight that came from a GGUF file may also keep its blocks (``attach_gguf``): products of up
to as many rows as this CPU measured the blocks at least as fast as the float weights
(``linear_rules``) then read the quantized codes (0.75 byte a weight for Q4_1, 1.125
for Q8_0, scales included, against 4 in fp32 and 2 in bf16) through ``kernels.gguf``, which
dequantizes them exactly to the float weights the other paths use (in registers, by tiles of
rows or by panels kept in cache, as the CPU measured faster);
longer products, prompt chunks, keep oneDNN's float paths. On a GPU the Triton kernels race
cuBLAS the same way, and serve no rows where they lose at one (as on an H200).

A weight quantized at load time (``quantization``, ``duet.models.quantize``) keeps its blocks
alone (``weight`` is None): longer products dequantize it for the call. W8A8's products with a
scale per channel go in integers where this CPU measured that faster (``kernels.w8a8``).

An LM head whose rows only need their greedy token (``argmax``) skips writing its logits.

A float weight may also be laid out in panels (``kernels/csrc/batch_invariant.cpp``: each output
summed over k by one fused multiply-add a k, a thread per panel, tiles of rows by outer products),
which serves fp32 products of up to as many rows as this CPU measured it faster than oneDNN's and
MKL's paths (``linear_rules``, once per machine), and replaces oneDNN's copy where it
serves the rows that copy would. Under ``batch_invariant`` (``duet.models.batch_invariant``)
every product sums each output over k in that one order whatever the row count
(``make_batch_invariant``): by those panels, the GGUF blocks by theirs, W8A8 in integers.

Where a step has rows with LoRA adapters (``duet.lora``), each adapter's low-rank update is
added to its rows after the base product, whichever path computed it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from duet.dtypes import cpu_has_fast_bf16
from duet.kernels import cpu_ops
from duet.kernels.fused import greedy_argmax
from duet.kernels.gguf import GGUFWeight
from duet.kernels.w8a8 import FLOAT8_PER_TOKEN, INT8_PER_TOKEN, Int8Weight, StaticInput, exact_int8_sums, int8_linear, int8_min_rows, quantize_input
from duet.lora import current_step as current_lora_step
from duet.models.linear_rules import (
    CHUNK_ROWS, GGUF_MAX_ROWS, PACK_BATCH_HINT, blocks_only_max_rows, float_panel_rows, float_panels, gguf_float_max_rows, packed_wins,
)
from duet.models.module import Module

logger = logging.getLogger(__name__)

_PACKED_ROWS = {torch.float32: (2, 128), torch.bfloat16: (1, 128)}  # rows oneDNN's reordered weight serves


class Linear(Module):
    """``y = x @ W.T``; ``W`` is ``[out_features, in_features]`` as in Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.packed_weight: torch.Tensor | None = None
        self._packed_rows = (0, -1)
        self.gguf: GGUFWeight | None = None
        self._block_rows = -1  # products of up to this many rows read the GGUF blocks (none: not even empty ones)
        self.blocks_dtype: torch.dtype | None = None  # where the blocks alone are the weight: the model's dtype
        self.lora_name: str | None = None  # its module name where LoRA adapters may update it (``duet.lora``)
        # The weight laid out in panels (``kernels/csrc/batch_invariant.cpp``), serving products of
        # up to ``_panel_rows`` rows (none: not even empty ones): those this CPU measured faster
        # than oneDNN's and MKL's, or every product under batch_invariant.
        self.invariant_panels: torch.Tensor | None = None
        self._panel_rows = -1
        # The input features in the order the weight's columns hold them (GPTQ's activation
        # order, its groups made contiguous: ``duet.models.gptq``); None: as given.
        self.input_order: torch.Tensor | None = None
        # How the input is quantized before the product (W8A8's ``w8a8.INT8_PER_TOKEN`` or
        # ``FLOAT8_PER_TOKEN``: ``w8a8.dynamic_per_token``; a static scheme's ``w8a8.StaticInput``);
        # None: not.
        self.input_quantization: str | StaticInput | None = None
        # Where its input features are split over tensor-parallel ranks: each row's largest
        # magnitude over every rank's features, from this rank's (the scale W8A8 quantizes by).
        self.input_row_max: Callable[[torch.Tensor], torch.Tensor] | None = None
        # W8A8's int8 weight, for products of ``_int8_rows`` rows or more (``use_int8_products``).
        self.int8: Int8Weight | None = None
        self._int8_rows = cpu_ops.NEVER
        # A tensor-parallel shard's place in the whole weight (``tensor_parallel.PartOfWeight``); None: whole.
        self.part_of = None

    def pack_for_cpu(self) -> None:
        """Lay the weight out once for the paths this CPU and dtype benefit from: panels for the
        row counts where they measured faster (fp32), oneDNN's reordered weight for the others."""
        rows = _PACKED_ROWS.get(self.weight.dtype)
        if rows is None or self.weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return
        if self.weight.dtype == torch.bfloat16 and not cpu_has_fast_bf16():
            return  # oneDNN would emulate bf16 on AVX2-only CPUs; the plain path is the safe one
        low, high = rows
        if self.weight.dtype == torch.float32:
            low, high = (1 if packed_wins(1) else low), (sys.maxsize if packed_wins(CHUNK_ROWS) else high)
            panel_rows = float_panel_rows()
            if panel_rows > 0:
                self._lay_out_float_panels()
                self._panel_rows = panel_rows
                low = max(low, panel_rows + 1)
        if low <= high:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_BATCH_HINT)
        self._packed_rows = (low, high)

    def _lay_out_float_panels(self) -> None:
        if self.invariant_panels is None:
            self.invariant_panels = float_panels(self.weight.detach(), cpu_ops.load_gguf().invariant_panel_width())

    def attach_gguf(self, weight: GGUFWeight) -> None:
        """Serve small products from ``weight``; the float weight stays for the rest and must be
        ``weight`` dequantized (and rounded to bf16, for a bf16 model)."""
        self.gguf = weight
        # The blocks' device, not the float weight's: that is on meta where the blocks are the weight.
        dtype = torch.float32 if self.weight is None else self.weight.dtype  # None: the blocks alone are the weight
        self._block_rows = gguf_float_max_rows(weight.ops, dtype, weight.codes.device.type)
        if 0 < self._panel_rows <= self._block_rows:  # the blocks serve every row count the float panels would
            self.invariant_panels, self._panel_rows = None, -1
        self._lay_out_panels()

    def _lay_out_panels(self) -> None:
        """Lay the blocks out for panels too, where products they serve go by panels."""
        ops = self.gguf.ops
        if not hasattr(ops, "panel_min_rows"):
            return
        bf16 = self.weight is not None and self.weight.dtype == torch.bfloat16
        if (ops.bf16_panel_min_rows() if bf16 else ops.panel_min_rows()) <= self._block_rows:
            self.gguf.lay_out_panels()

    def make_batch_invariant(self) -> None:
        """Compute every product, whatever its rows, in one order for each output (``duet.models.
        batch_invariant``): from the GGUF blocks by panels where they have the panel layout (the
        same arithmetic, a fused multiply-add a k from zero, as on their float weights), else from
        the float weight laid out for ``invariant_linear``, else (blocks alone without the panel
        layout: CPUs without AVX-512, or outputs no whole number of panels) from the blocks by
        tiles of rows for every row count (each output summed in one order whatever the tile's
        rows, ``csrc/gguf_blocks.h``; slower for prompts, which would have gone by floats). The
        other paths' copies are dropped."""
        if self.int8 is not None:  # W8A8 in integers (taken only where exact): the same sums whatever the rows
            self._int8_rows = 1
            return
        blocks = self.gguf
        if blocks is not None and self.weight is not None and self.weight.dtype != torch.float32 and not blocks.ops.has_bf16():
            blocks = None  # bf16 rows the blocks' kernels do not take here
        if blocks is not None:
            blocks.lay_out_panels()
        if blocks is not None and blocks.panel_codes is not None:
            blocks.panel_min_rows = 1
            self._block_rows = sys.maxsize
            self.invariant_panels, self._panel_rows = None, -1
        elif self.weight is not None:
            self._lay_out_float_panels()
            self._panel_rows = sys.maxsize
            self.gguf = None
            self._block_rows = -1
        else:  # blocks alone
            blocks.panel_min_rows = cpu_ops.NEVER
            self._block_rows = sys.maxsize
        self.packed_weight = None
        self._packed_rows = (0, -1)

    def keep_blocks_only(self, dtype: torch.dtype | None = None) -> None:
        """Drop the float weight (and its packed and panel copies): the attached blocks are the
        weight of a model of ``dtype`` (default: the dropped weight's). They serve products of up
        to ``blocks_only_max_rows`` rows in an fp32 model on CPU, ``GGUF_MAX_ROWS`` elsewhere (a
        bf16 model's weight dequantized for the call multiplies in bf16, which tied with the
        blocks' fp32 products on an AMD EPYC with AVX512_BF16); longer products dequantize them
        for the call."""
        self.blocks_dtype = dtype or (self.blocks_dtype if self.weight is None else self.weight.dtype)
        self.weight = None
        self.packed_weight = None
        self.invariant_panels, self._panel_rows = None, -1
        self._packed_rows = (0, -1)
        fp32_cpu = self.blocks_dtype == torch.float32 and self.gguf.codes.device.type == "cpu"
        self._block_rows = blocks_only_max_rows() if fp32_cpu else GGUF_MAX_ROWS
        self._lay_out_panels()

    def use_int8_products(self) -> None:
        """W8A8's products in integers (from the rows this CPU measured faster) where the blocks allow."""
        if self.input_quantization == INT8_PER_TOKEN and self.gguf is not None and self.input_order is None:
            rows = int8_min_rows()  # never where this CPU's int8 product is not exact: no packed copy then
            self.int8 = Int8Weight.from_blocks(self.gguf) if rows < cpu_ops.NEVER and exact_int8_sums() else None
            self._int8_rows = cpu_ops.NEVER if self.int8 is None else rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= self._int8_rows and self.input_quantization is not None:
            y = int8_linear(x, self.int8, self.input_row_max)
        else:
            quantized = x if self.input_quantization is None else quantize_input(x, self.input_quantization, self.input_row_max)
            y = self._product(self._ordered(quantized))
        step = None if self.lora_name is None else current_lora_step()
        return y if step is None else step.apply(self.lora_name, x, y)

    def _ordered(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.input_order is None else x.index_select(-1, self.input_order)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is None:  # quantized at load time
            if x.shape[0] > self._block_rows:
                return F.linear(x, self.gguf.dequantize().to(x.dtype))
            return self.gguf.matmul(x.float()).to(x.dtype)
        if x.shape[0] <= self._block_rows:  # blocks attached to a float32 or bfloat16 model
            return self.gguf.matmul(x)
        if x.shape[0] <= self._panel_rows:
            return cpu_ops.load_gguf().invariant_linear(x, self.invariant_panels, self.out_features).to(x.dtype)
        low, high = self._packed_rows
        if low <= x.shape[0] <= high:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")
        return F.linear(x, self.weight)

    def plan(self) -> tuple:
        """What ``forward`` chooses from, for the C++ decoder stack (``duet.models.decoder_stack``)
        to choose the same way: ``(weight, packed_weight, packed_low, packed_high, codes, scales,
        qtype, block_rows, panel_codes, panel_scales, invariant_panels, out_features, panel_rows,
        panel_min_rows, input_order, *Int8Weight's four, float8_inputs, float8_scale)``, None for
        what this layer lacks; the int8 weight only where every row count goes in integers in one
        call (``int8_at_every_row``); ``float8_inputs`` where each input is quantized to float8
        first in one call (``float8_inputs_in_one_call``), at ``float8_scale`` (a static scheme's)
        or per token."""
        blocks = self.gguf
        low, high = self._packed_rows
        invariant = (self.invariant_panels, self.out_features, self._panel_rows)
        int8 = (self.int8.packed, self.int8.scales, self.int8.unit_scales, self.int8.zero_points) if self.int8_at_every_row else (None,) * 4
        scheme = self.input_quantization
        float8 = (self.float8_inputs_in_one_call, scheme.scale if isinstance(scheme, StaticInput) else None)
        if blocks is None:
            return (
                self.weight, self.packed_weight, low, high, None, None, 0, self._block_rows, None, None, *invariant, -1, self.input_order, *int8,
                *float8,
            )
        return (
            self.weight, self.packed_weight, low, high, blocks.codes, blocks.scales, blocks.qtype, self._block_rows,
            blocks.panel_codes, blocks.panel_scales, *invariant, blocks.panel_min_rows, self.input_order, *int8, *float8,
        )

    @property
    def float8_inputs_in_one_call(self) -> bool:
        """Whether each input is quantized to float8 in one C++ call (``kernels.w8a8``'s
        ``float8_rows``): FP8 W8A8 per token over the row's own features (one process), or at a
        static scheme's one scale."""
        scheme = self.input_quantization
        if isinstance(scheme, StaticInput):
            return scheme.in_one_call
        return scheme == FLOAT8_PER_TOKEN and self.input_row_max is None

    @property
    def int8_at_every_row(self) -> bool:
        """Whether every product goes in integers in one C++ call (W8A8 whole rows, ``int8_linear``)."""
        return self.int8 is not None and self._int8_rows <= 1 and self.input_quantization is not None and self.input_row_max is None

    def argmax(self, x: torch.Tensor, excluded_token_ids: torch.Tensor) -> torch.Tensor:
        """``greedy_argmax(self(x).float(), excluded_token_ids)``: an LM head's greedy tokens.
        Rows the GGUF blocks serve (fp32, or bf16 against a bf16 model's weights) never write
        their products out (the kernel keeps each row's best as it goes: the same products,
        rounded to bf16 for bf16 rows, so the same tokens)."""
        fused = x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and self.weight is not None)
        if fused and x.shape[0] <= self._block_rows:
            return self.gguf.matmul_argmax(self._ordered(x), excluded_token_ids)
        return greedy_argmax(self(x).float(), excluded_token_ids)
