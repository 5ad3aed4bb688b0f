"""Paged-attention cases shared by the Triton kernel tests (under the interpreter, and on a GPU):
a batch of sequences in a shuffled paged cache, and a float64 reference."""

from __future__ import annotations

import torch

from duet.kernels.metadata import AttentionMetadata


def build_batch(spans, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Fill a NaN-initialised cache for sequences given as ``(context_len, query_len)``.

    Blocks are handed out from a random permutation, so block ids are shuffled and
    non-contiguous; unused slots stay NaN so a kernel reading past a sequence shows up.
    """
    generator = torch.Generator().manual_seed(seed)
    seq_lens = [context + query for context, query in spans]
    blocks_per_seq = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    block_ids = torch.randperm(num_blocks, generator=generator)[: sum(blocks_per_seq)].tolist()

    cache_shape = (num_kv_heads, num_blocks, block_size, head_dim)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    block_tables = torch.zeros(len(spans), max(blocks_per_seq) + 1, dtype=torch.int32)
    slot_mapping = []
    for seq, (context_len, query_len) in enumerate(spans):
        own_blocks = [block_ids.pop() for _ in range(blocks_per_seq[seq])]
        block_tables[seq, : len(own_blocks)] = torch.tensor(own_blocks, dtype=torch.int32)
        for position in range(context_len + query_len):
            block, offset = own_blocks[position // block_size], position % block_size
            key_cache[:, block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator).to(dtype)
            value_cache[:, block, offset] = torch.randn(num_kv_heads, head_dim, generator=generator).to(dtype)
            if position >= context_len:
                slot_mapping.append(block * block_size + offset)

    query_lens = [query for _, query in spans]
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        query_lens=query_lens,
        seq_lens_list=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    query = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=generator).to(dtype)
    return query, key_cache, value_cache, metadata


def reference_attention(query, key_cache, value_cache, metadata, scale):
    """Per sequence: gather K/V by position, mask causally with the context offset, float64."""
    block_size = key_cache.shape[2]
    group = query.shape[1] // key_cache.shape[0]
    outputs = []
    for seq, (query_len, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens_list)):
        positions = torch.arange(seq_len)
        blocks = metadata.block_tables[seq, positions // block_size].long()
        keys = key_cache[:, blocks, positions % block_size].double().repeat_interleave(group, dim=0)
        values = value_cache[:, blocks, positions % block_size].double().repeat_interleave(group, dim=0)
        start = int(metadata.query_start_loc[seq])
        seq_query = query[start : start + query_len].double().transpose(0, 1)  # [heads, q, d]
        scores = seq_query @ keys.transpose(1, 2) * scale
        query_positions = seq_len - query_len + torch.arange(query_len)
        scores = scores.masked_fill(positions[None, :] > query_positions[:, None], float("-inf"))
        outputs.append((scores.softmax(dim=-1) @ values).transpose(0, 1))
    return torch.cat(outputs)
