"""One forward pass's flat token batch, built from each sequence's span of new tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from duet.kernels import AttentionMetadata
from duet.kernels.cascade import CascadePlanner


@dataclass
class Span:
    """A sequence's tokens for one forward pass: ``token_ids`` sit at positions ``start`` onward,
    and its KV lives in ``block_ids`` (which must cover every position up to the span's end).
    ``prompt_len``: its sequence's prompt length (``AttentionMetadata.prompt_lens``), 0 for none."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    prompt_len: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    # [i]: the flat row just past span i's tokens.
    span_ends: list[int]


def build_batch(spans: list[Span], block_size: int, device: str, cascade: CascadePlanner | None = None) -> BatchInputs:
    """Pack the spans back to back, with positions, cache slots and block tables for attention
    (with ``cascade``, the groups of sequences whose decode rows attend to shared blocks once)."""
    input_ids: list[int] = []
    positions, slots, block_rows, query_lens, seq_lens, span_ends = [], [], [], [], [], []
    offset = 0
    for span in spans:
        input_ids.extend(span.token_ids)
        pos = np.arange(span.start, span.end, dtype=np.int64)
        table = np.asarray(span.block_ids, dtype=np.int64)
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        block_rows.append(table)
        query_lens.append(len(span.token_ids))
        seq_lens.append(span.end)
        offset += len(span.token_ids)
        span_ends.append(offset)
    max_blocks = max(len(row) for row in block_rows)
    block_tables = np.zeros((len(block_rows), max_blocks), dtype=np.int32)
    for row, table in enumerate(block_rows):
        block_tables[row, : len(table)] = table
    query_start_loc = np.zeros(len(query_lens) + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    metadata = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(block_tables).to(device),
        query_lens=query_lens,
        seq_lens_list=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        prompt_lens=[span.prompt_len for span in spans],
        cascade=[] if cascade is None else cascade.groups(block_tables, query_lens, seq_lens, block_size),
    )
    return BatchInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.from_numpy(np.concatenate(positions)).to(device),
        metadata=metadata,
        span_ends=span_ends,
    )
