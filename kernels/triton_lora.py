"""LoRA updates on a GPU: the Triton twin of ``csrc/lora.cpp`` (``duet.lora.LoRAStep``), every
row's ``y[i] += (x[i] A^T) B^T`` in one launch, A and B^T those of row i's adapter.

A step's rows are grouped by adapter on the host, where the step's slots are known, into blocks
of ``ROW_BLOCK`` rows of one adapter (``LoRABlocks``): a program takes one block and reads its
adapter's A and B^T once for all its rows (reading them is most of the work), the segmented
product the C++ kernel computes with threads. Each module's adapters are reached through a table
of their tensors' addresses and ranks (``LoRABlocks.table``: one host-to-device copy a step, for
every module), so that adapters of any rank and dtype need no stacked copy; an adapter that
leaves a module out has rank 0 there and its blocks return at once. The rank terms ``x A^T`` are
summed in fp32 and kept so, the update added to the row in fp32 and rounded once to its dtype,
as the C++ kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_BLOCK = 8  # rows of one adapter that share each read of its A and B^T


@triton.jit
def _lora_kernel(
    x_ptr, y_ptr, rows_ptr, slots_ptr, a_ptrs, bt_ptrs, ranks_ptr, weight_ptr, in_features, out_features, stride_x, stride_y,
    R: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``weight_ptr``: any adapter weight of the module, for its element type (every slot's is the same)."""
    block = tl.program_id(0)
    slot = tl.load(slots_ptr + block)
    rank = tl.load(ranks_ptr + slot)
    if rank == 0:  # the adapter leaves this module out
        return
    rows = tl.load(rows_ptr + block * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # -1 past the block's rows
    row_mask = rows >= 0
    rows = tl.where(row_mask, rows, 0)
    a = tl.load(a_ptrs + slot).to(tl.pointer_type(weight_ptr.dtype.element_ty))
    bt = tl.load(bt_ptrs + slot).to(tl.pointer_type(weight_ptr.dtype.element_ty))
    r = tl.arange(0, R)
    r_mask = r < rank
    terms = tl.zeros([ROWS, R], dtype=tl.float32)  # x A^T, each row's rank terms
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < in_features
        xs = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        ak = tl.load(a + r[:, None] * in_features + k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        terms += tl.sum(xs.to(tl.float32)[:, None, :] * ak.to(tl.float32)[None, :, :], axis=2)
    for n0 in range(0, out_features, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < out_features
        b = tl.load(bt + r[:, None] * out_features + n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        update = tl.sum(terms[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        mask = row_mask[:, None] & n_mask[None, :]
        offsets = rows[:, None] * stride_y + n[None, :]
        y = tl.load(y_ptr + offsets, mask=mask, other=0.0)
        tl.store(y_ptr + offsets, (y.to(tl.float32) + update).to(y.dtype), mask=mask)


class LoRABlocks:
    """One step's rows grouped by adapter for ``lora_add_triton``: ``adapters_weights`` is, per
    slot, the adapter's ``{module name: (A, B^T)}``; ``row_slots`` each row's slot (-1: the base)."""

    def __init__(self, adapters_weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]], row_slots: list[int], device) -> None:
        self._adapters = adapters_weights
        self.device = torch.device(device)
        blocks, slots = [], []
        for slot in range(len(adapters_weights)):
            rows = [row for row, row_slot in enumerate(row_slots) if row_slot == slot]
            for first in range(0, len(rows), ROW_BLOCK):
                chunk = rows[first : first + ROW_BLOCK]
                blocks.append(chunk + [-1] * (ROW_BLOCK - len(chunk)))
                slots.append(slot)
        self.num_blocks = len(blocks)
        self.rows = torch.tensor(blocks or [[-1] * ROW_BLOCK], dtype=torch.int32, device=self.device)
        self.slots = torch.tensor(slots or [0], dtype=torch.int32, device=self.device)
        self._modules: dict[str, int] | None = None
        self._table: torch.Tensor | None = None  # [3, modules, slots]: A's and B^T's addresses, ranks
        self._max_rank: dict[str, int] = {}
        self._weight: dict[str, torch.Tensor] = {}  # one of the module's adapter weights: their element type

    def table(self, module_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The module's A and B^T addresses and ranks by slot (None: no adapter of the step has it)."""
        if self._modules is None:
            names = sorted({name for weights in self._adapters for name in weights})
            self._modules = {name: index for index, name in enumerate(names)}
            rows = [[], [], []]
            for name in names:
                held = [weights.get(name) for weights in self._adapters]
                rows[0].append([0 if w is None else w[0].data_ptr() for w in held])
                rows[1].append([0 if w is None else w[1].data_ptr() for w in held])
                rows[2].append([0 if w is None else w[0].shape[0] for w in held])
                self._max_rank[name] = max(rows[2][-1])
                self._weight[name] = next(w[0] for w in held if w is not None)
            self._table = torch.tensor(rows, dtype=torch.int64, device=self.device) if names else None
        index = self._modules.get(module_name)
        if index is None:
            return None
        return self._table[0, index], self._table[1, index], self._table[2, index]

    def max_rank(self, module_name: str) -> int:
        return self._max_rank[module_name]

    def weight(self, module_name: str) -> torch.Tensor:
        return self._weight[module_name]


def lora_add_triton(y: torch.Tensor, x: torch.Tensor, blocks: LoRABlocks, module_name: str, block_k: int = 32, block_n: int = 32) -> None:
    """``y`` (the base product of ``x``, ``[rows, out]``) with each row's adapter's update
    added, in place."""
    table = blocks.table(module_name)
    if table is None or blocks.num_blocks == 0:
        return
    if x.stride(1) != 1 or y.stride(1) != 1:
        raise ValueError("lora_add_triton: rows of x and y must be contiguous")
    a_ptrs, bt_ptrs, ranks = table
    rank = max(1, triton.next_power_of_2(blocks.max_rank(module_name)))
    _lora_kernel[(blocks.num_blocks,)](
        x, y, blocks.rows, blocks.slots, a_ptrs, bt_ptrs, ranks, blocks.weight(module_name), x.shape[1], y.shape[1], x.stride(0),
        y.stride(0), R=rank, ROWS=ROW_BLOCK, BLOCK_K=block_k, BLOCK_N=block_n,
    )
