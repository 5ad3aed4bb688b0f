"""Copies of whole KV blocks between tensors laid out ``[..., ..., ..., blocks, block_size, width]``
(a KV cache, a second tier's store, a transfer's packed run): a run of consecutive blocks at a
time, one strided copy per run and no temporary, where a gather and a scatter would write every
byte twice more."""

from __future__ import annotations

import torch


def copy_block_runs(destination: torch.Tensor, source: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """``destination[:, :, :, d] = source[:, :, :, s]`` for each ``(s, d)`` in order, a run of
    pairs consecutive on both sides at a time."""
    index = 0
    while index < len(pairs):
        start_source, start_destination = pairs[index]
        end = index + 1
        while end < len(pairs) and pairs[end] == (start_source + end - index, start_destination + end - index):
            end += 1
        length = end - index
        destination[:, :, :, start_destination : start_destination + length].copy_(
            source[:, :, :, start_source : start_source + length], non_blocking=destination.is_cuda or source.is_cuda
        )
        index = end


def num_runs(block_ids: list[int]) -> int:
    """How many runs of consecutive ids ``block_ids`` holds (``copy_block_runs``' copies, where
    the other side is consecutive)."""
    return sum(1 for index, block in enumerate(block_ids) if index == 0 or block != block_ids[index - 1] + 1)
