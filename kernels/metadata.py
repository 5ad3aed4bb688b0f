"""The per-step description of a batch that attention kernels read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's queries sit in the flat token batch and where its KV lives.

    A step packs the new tokens of all sequences into one flat batch of ``num_tokens``
    rows, sequence after sequence. Sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i + 1]``; after this step's KV is written it has
    ``seq_lens[i]`` tokens of context, so its ``j``-th query token sits at absolute
    position ``seq_lens[i] - query_len_i + j`` and attends causally to positions
    ``0..that position``. Its KV is in the blocks ``block_tables[i, :ceil(seq_lens[i] /
    block_size)]`` (rows padded with 0). ``slot_mapping[t]`` is the flat cache slot
    ``block_id * block_size + offset`` that new token ``t`` writes its K and V to.

    Host-side copies (``query_lens``, ``seq_lens_list``) let CPU implementations plan
    without device syncs.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_lens: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    # Each sequence's prompt length (RoPE scalings that depend on a sequence's length read it:
    # a prompt's tokens all see the whole prompt's); None: every token sees its position + 1.
    prompt_lens: list[int] | None = None
    # Cascade attention's groups (``duet.kernels.cascade``): each ``[prefix_tokens, seq, seq, ...]``,
    # decode sequences whose first ``prefix_tokens`` of KV lie in the same blocks; the CPU decode
    # kernel attends to those once for the whole group. Empty: every row alone.
    cascade: list[list[int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)
