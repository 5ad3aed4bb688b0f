"""Paged attention and KV-cache write in plain torch: the CPU path and the reference.

Cache layout per layer: ``[num_kv_heads, num_blocks, block_size, head_dim]``. Heads come
first so that gathering a batch's blocks yields ``[num_kv_heads, num_seqs, tokens,
head_dim]`` at once, ready for batched matmuls without a transpose. A quantized cache
(``kv_quant``) has rows of ``head_dim + 1``; gathered blocks are dequantized to the query's dtype.
"""

from __future__ import annotations

import torch

from duet.kernels.kv_quant import cache_bytes_view, dequantize_rows, head_dim_of, is_quantized, quantize_rows
from duet.kernels.metadata import AttentionMetadata

# Sequences with at most this many query tokens (decode steps, speculative verification)
# are attended together in one padded batch; longer ones (prompt chunks) one by one.
MAX_BATCHED_QUERY_LEN = 8


def write_kv_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K and V (``[num_tokens, num_kv_heads, head_dim]``) at its slot."""
    for new, cache in ((key, key_cache), (value, value_cache)):
        rows = quantize_rows(new, cache.dtype) if is_quantized(cache) else new.to(cache.dtype)
        num_kv_heads, num_blocks, block_size, width = cache.shape
        flat = cache_bytes_view(cache).view(num_kv_heads, num_blocks * block_size, width)
        flat.index_copy_(1, slot_mapping, cache_bytes_view(rows).transpose(0, 1))


def paged_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    native_ops=None,
    window: int | None = None,
    softcap: float | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Causal attention of ``query`` (``[num_tokens, num_heads, head_dim]``) over paged KV.

    Short queries (decode, verification) go to ``native_ops.paged_attention`` when given
    (the C++ CPU kernels), else to one padded batch of torch matmuls; prompt chunks go to
    ``native_ops.prompt_attention`` (tiles of query rows against chunks of keys), or one by
    one to ``scaled_dot_product_attention`` where it declines the head size or is not given.
    A ``window`` (each query sees keys less than ``window`` positions back) is computed by both
    C++ kernels; a ``softcap`` (scores ``softcap * tanh(score / softcap)``, as transformers'
    Gemma computes them) by the prompt kernel, and in torch for short queries. ``batch_invariant``:
    every row, short queries too, goes to ``native_ops.prompt_attention``, which computes each row
    alone over chunks of keys of fixed size from position 0 (``supports_batch_invariance``).
    """
    window_arg, softcap_arg = window or 0, softcap or 0.0
    if batch_invariant:
        output = torch.empty_like(query)
        if not native_ops.prompt_attention(
            output, query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, list(range(metadata.num_seqs)), scale, window_arg, softcap_arg,
        ):
            raise ValueError(f"batch-invariant attention does not take heads of {query.shape[-1]}")
        return output
    output = torch.empty_like(query)
    short = [i for i, q_len in enumerate(metadata.query_lens) if q_len <= MAX_BATCHED_QUERY_LEN]
    if short and native_ops is not None and softcap is None:  # the short-query kernel has no cap
        native_ops.paged_attention(
            output, query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, short, scale, window_arg, metadata.cascade,
        )
    elif short:
        _attend_short_queries(query, key_cache, value_cache, metadata, scale, short, output, window, softcap)
    if len(short) < metadata.num_seqs:
        short_set = set(short)
        chunks = [seq for seq in range(metadata.num_seqs) if seq not in short_set]
        if native_ops is None or not native_ops.prompt_attention(
            output, query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, chunks, scale, window_arg, softcap_arg,
        ):
            starts = metadata.query_start_loc.tolist()
            for seq in chunks:
                _attend_one_sequence(query, key_cache, value_cache, metadata, scale, seq, starts[seq], output, window, softcap)
    return output


def supports_batch_invariance(head_dim: int) -> bool:
    """Whether ``paged_attention_torch(batch_invariant=True)`` takes heads of ``head_dim`` here."""
    from duet.kernels import cpu_ops

    ops = cpu_ops.load()
    return ops is not None and ops.prompt_attention_takes(head_dim)


def _gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """``[kv_heads, seqs, num_blocks * block_size, head_dim]`` for the given block table rows, in
    the cache's dtype, or in ``dtype`` when the cache is quantized."""
    num_kv_heads, _, block_size, width = cache.shape
    gathered = cache[:, block_tables[:, :num_blocks]]
    gathered = gathered.view(num_kv_heads, block_tables.shape[0], num_blocks * block_size, width)
    return dequantize_rows(gathered, dtype) if is_quantized(cache) else gathered


def _compute_dtype(cache: torch.Tensor, query: torch.Tensor) -> torch.dtype:
    return query.dtype if is_quantized(cache) else cache.dtype


def _capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _attend_short_queries(query, key_cache, value_cache, metadata, scale, seqs, output, window=None, softcap=None) -> None:
    """All short-query sequences at once: one gather, two batched matmuls, one softmax."""
    num_kv_heads, _, block_size, _ = key_cache.shape
    head_dim = head_dim_of(key_cache)
    dtype = _compute_dtype(key_cache, query)
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    query_lens = [metadata.query_lens[i] for i in seqs]
    seq_lens = [metadata.seq_lens_list[i] for i in seqs]
    max_q = max(query_lens)
    max_len = max(seq_lens)
    num_blocks = -(-max_len // block_size)
    all_seqs = len(seqs) == metadata.num_seqs
    uniform = all_seqs and max_q == 1

    if uniform:
        rows = None
        q = query
    else:
        starts = metadata.query_start_loc.tolist()
        row_index = [[starts[s] + min(j, q_len - 1) for j in range(max_q)] for s, q_len in zip(seqs, query_lens)]
        rows = torch.tensor(row_index, dtype=torch.long)
        q = query[rows.view(-1)]
    num_seqs = len(seqs)
    tables = metadata.block_tables if all_seqs else metadata.block_tables[torch.tensor(seqs, dtype=torch.long)]
    keys = _gather_blocks(key_cache, tables, num_blocks, dtype)
    values = _gather_blocks(value_cache, tables, num_blocks, dtype)

    # [seqs * max_q, heads, d] -> [kv_heads, seqs, max_q * group, d]
    q = q.view(num_seqs, max_q, num_kv_heads, group, head_dim).permute(2, 0, 1, 3, 4)
    q = q.reshape(num_kv_heads, num_seqs, max_q * group, head_dim).to(dtype)
    scores = _capped(torch.matmul(q, keys.transpose(-1, -2)).float() * scale, softcap)

    device = query.device
    key_pos = torch.arange(num_blocks * block_size, device=device)
    seq_lens_t = torch.tensor(seq_lens, device=device)
    if max_q == 1 and window is None:
        visible = key_pos[None, :] < seq_lens_t[:, None]
        visible = visible[:, None, :]
    else:
        q_pos = seq_lens_t[:, None] - torch.tensor(query_lens, device=device)[:, None] + torch.arange(max_q, device=device)[None, :]
        visible = key_pos[None, None, :] <= q_pos[:, :, None]
        if window is not None:
            visible &= key_pos[None, None, :] > q_pos[:, :, None] - window
        visible = visible.repeat_interleave(group, dim=1)
    scores.masked_fill_(~visible[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values)  # [kv_heads, seqs, max_q * group, d]
    out = out.view(num_kv_heads, num_seqs, max_q, group, head_dim).permute(1, 2, 0, 3, 4)
    out = out.reshape(num_seqs * max_q, num_heads, head_dim).to(output.dtype)
    if rows is None:
        output.copy_(out)
        return
    keep = torch.tensor([j < q_len for q_len in query_lens for j in range(max_q)])
    output[rows.view(-1).to(device)[keep.to(device)]] = out[keep.to(device)]


def _attend_one_sequence(query, key_cache, value_cache, metadata, scale, seq, start, output, window=None, softcap=None) -> None:
    """A prompt chunk: SDPA over its cached context plus itself, causal from its offset (with a
    window or a cap, the same by explicit matmuls and softmax)."""
    block_size = key_cache.shape[2]
    dtype = _compute_dtype(key_cache, query)
    q_len = metadata.query_lens[seq]
    seq_len = metadata.seq_lens_list[seq]
    num_blocks = -(-seq_len // block_size)
    table = metadata.block_tables[seq : seq + 1]
    keys = _gather_blocks(key_cache, table, num_blocks, dtype)[:, 0, :seq_len]
    values = _gather_blocks(value_cache, table, num_blocks, dtype)[:, 0, :seq_len]
    q = query[start : start + q_len].transpose(0, 1).to(dtype)  # [heads, q_len, d]
    context = seq_len - q_len
    if window is not None or softcap is not None:
        device = query.device
        q_pos = torch.arange(context, seq_len, device=device)[:, None]
        key_pos = torch.arange(seq_len, device=device)[None, :]
        visible = key_pos <= q_pos
        if window is not None:
            visible &= key_pos > q_pos - window
        group = q.shape[0] // keys.shape[0]
        scores = torch.matmul(q, keys.repeat_interleave(group, dim=0).transpose(-1, -2)).float() * scale
        scores = _capped(scores, softcap).masked_fill(~visible[None], float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values.repeat_interleave(group, dim=0))
        output[start : start + q_len] = out.transpose(0, 1).to(output.dtype)
        return
    if context == 0:
        out = torch.nn.functional.scaled_dot_product_attention(
            q[None], keys[None], values[None], is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        q_pos = torch.arange(context, seq_len)
        mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, scale=scale, enable_gqa=True
        )
    output[start : start + q_len] = out[0].transpose(0, 1).to(output.dtype)
