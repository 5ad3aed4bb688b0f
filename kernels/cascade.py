"""Cascade attention's plan: which decode sequences of a step share blocks, and when sharing pays.

When a batch's sequences start with the same blocks (a system prompt or a document that the
prefix cache holds once), the CPU decode kernel can attend to those blocks once for the whole
group, as two matrix products per KV head, and merge each row's part over its own remaining
keys by log-sum-exp (``csrc/cascade.h``). A group is the sequences whose first block is the
same; its prefix is the leading blocks every member's table holds alike, wholly before every
member's query rows.

Whether a group pays depends on how many rows share the prefix and how long it is: few rows
over a short prefix cost the products' fixed price without reading much less. ``auto`` asks a
``CascadeRule`` measured once per machine (``cpu_rules``), with the model's heads: for each group
size, the shortest prefix from which the cascade is faster (``fit_rule``). ``on`` takes every
group of two sequences or more over at least one block; ``off`` none. The values differ from the
plain kernel's only in the order of their additions, so greedy tokens stay transformers'.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from duet.kernels.cpu_rules import remembered

logger = logging.getLogger(__name__)

# Group sizes and prefix lengths at which fit_rule times both ways, and the margin by which the
# cascade must win (a noisy tie keeps the plain kernel).
FIT_SEQS = (2, 4, 8, 16, 32)
FIT_PREFIX_TOKENS = (64, 128, 256, 512, 1024, 2048)
FIT_MARGIN = 1.1
FIT_SUFFIX_TOKENS = 32
NEVER = 1 << 30


@dataclass(frozen=True)
class CascadeRule:
    """A group of ``n`` sequences cascades when its prefix has at least
    ``min_prefix_tokens[i]`` tokens, ``i`` the last of ``seqs`` not above ``n``."""

    seqs: tuple[int, ...]
    min_prefix_tokens: tuple[int, ...]

    def takes(self, num_seqs: int, prefix_tokens: int) -> bool:
        index = int(np.searchsorted(self.seqs, num_seqs, side="right")) - 1
        return index >= 0 and prefix_tokens >= self.min_prefix_tokens[index]


ALWAYS = CascadeRule(seqs=(2,), min_prefix_tokens=(1,))


def shared_prefixes(
    block_tables: np.ndarray, query_lens: list[int], seq_lens: list[int], block_size: int, max_query_len: int
) -> list[tuple[int, list[int]]]:
    """(prefix tokens, sequences) of each group of short-query sequences (at most
    ``max_query_len`` rows: the decode kernel's) that share their first blocks, wholly before
    every member's query rows."""
    by_first_block: dict[int, list[int]] = {}
    for seq, (query_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        if query_len <= max_query_len and seq_len - query_len >= block_size:
            by_first_block.setdefault(int(block_tables[seq, 0]), []).append(seq)
    groups = []
    for seqs in by_first_block.values():
        if len(seqs) < 2:
            continue
        whole_blocks = min((seq_lens[s] - query_lens[s]) // block_size for s in seqs)
        rows = block_tables[seqs, :whole_blocks]
        alike = (rows == rows[0]).all(axis=0)
        num_blocks = whole_blocks if alike.all() else int(alike.argmin())
        groups.append((num_blocks * block_size, seqs))
    return groups


class CascadePlanner:
    """A runner's cascade decisions (``AttentionMetadata.cascade``): ``on`` takes every group,
    ``auto`` asks ``fit_rule``'s rule, measured at the first step that has a group (once per
    machine and model shape) by ``fit``."""

    def __init__(self, mode: str, fit: Callable[[], CascadeRule]) -> None:
        if mode not in ("auto", "on"):
            raise ValueError(f"a cascade planner is auto or on, got {mode!r}")
        self.mode = mode
        self._fit = fit
        self.num_groups = 0  # groups planned so far

    def groups(self, block_tables: np.ndarray, query_lens: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
        from duet.kernels.torch_attention import MAX_BATCHED_QUERY_LEN

        shared = shared_prefixes(block_tables, query_lens, seq_lens, block_size, MAX_BATCHED_QUERY_LEN)
        if not shared:
            return []
        rule = ALWAYS if self.mode == "on" else self._fit()
        groups = [[prefix, *seqs] for prefix, seqs in shared if rule.takes(len(seqs), prefix)]
        self.num_groups += len(groups)
        return groups


@functools.cache
def fit_rule(
    ops, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int
) -> CascadeRule:
    """For each of ``FIT_SEQS``, the shortest of ``FIT_PREFIX_TOKENS`` (those of whole blocks)
    from which the cascade is ``FIT_MARGIN`` times faster than the plain decode kernel at it and
    every longer one measured (``NEVER`` if none): one query row a sequence with this model's heads, the prefix in
    consecutive blocks as a fresh cache holds it, best of 3 rounds each way. Once per machine
    and shape (``cpu_rules``)."""
    shape = f"{num_heads}x{num_kv_heads}x{head_dim}_{dtype}_{kv_dtype}_{block_size}".replace("torch.", "")
    chosen = remembered(
        f"cascade_min_prefix_tokens_{shape}",
        lambda: _timed_min_prefix_tokens(ops, num_heads, num_kv_heads, head_dim, dtype, kv_dtype, block_size),
    )
    rule = CascadeRule(seqs=FIT_SEQS, min_prefix_tokens=tuple(chosen))
    shown = ", ".join(f"{n} seqs from {'never' if t == NEVER else t}" for n, t in zip(rule.seqs, rule.min_prefix_tokens))
    logger.info("cascade attention on this CPU: %s prefix tokens", shown)
    return rule


def _timed_min_prefix_tokens(
    ops, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype, block_size: int
) -> list[int]:
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    prefixes = [tokens for tokens in FIT_PREFIX_TOKENS if tokens % block_size == 0]  # a prefix is whole blocks
    max_prefix = max(FIT_PREFIX_TOKENS)
    suffix_blocks = -(-(FIT_SUFFIX_TOKENS + 1) // block_size)
    num_blocks = max_prefix // block_size + max(FIT_SEQS) * suffix_blocks
    caches = []
    for _ in range(2):
        rows = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=generator)
        caches.append(_as_cache(rows, kv_dtype))
    chosen = []
    for num_seqs in FIT_SEQS:
        query = torch.randn(num_seqs, num_heads, head_dim, generator=generator).to(dtype)
        wins = []
        for prefix in prefixes:
            call = _fit_call(num_seqs, prefix, block_size, suffix_blocks)
            plain = _best_time(ops, query, caches, call, [])
            cascade = _best_time(ops, query, caches, call, [[prefix, *range(num_seqs)]])
            wins.append(plain >= FIT_MARGIN * cascade)
        first = next((i for i in range(len(wins)) if all(wins[i:])), None)
        chosen.append(NEVER if first is None else prefixes[first])
    logger.info("cascade attention's rule measured in %.2f s", time.perf_counter() - started)
    return chosen


def _as_cache(rows: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    from duet.kernels.kv_quant import QUANTIZED_DTYPES, quantize_rows

    return quantize_rows(rows, kv_dtype) if kv_dtype in QUANTIZED_DTYPES else rows.to(kv_dtype)


def _fit_call(num_seqs: int, prefix: int, block_size: int, suffix_blocks: int):
    """Block tables, lengths and query starts of ``num_seqs`` decode rows sharing ``prefix``."""
    prefix_blocks = prefix // block_size
    first_own = max(FIT_PREFIX_TOKENS) // block_size
    tables = torch.zeros(num_seqs, prefix_blocks + suffix_blocks, dtype=torch.int32)
    tables[:, :prefix_blocks] = torch.arange(prefix_blocks, dtype=torch.int32)
    for seq in range(num_seqs):
        own = first_own + seq * suffix_blocks
        tables[seq, prefix_blocks:] = torch.arange(own, own + suffix_blocks, dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), prefix + FIT_SUFFIX_TOKENS + 1, dtype=torch.int32)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    return tables, seq_lens, starts


def _best_time(ops, query, caches, call, cascade, rounds: int = 3, calls: int = 3) -> float:
    tables, seq_lens, starts = call
    out = torch.empty_like(query)
    seqs = list(range(query.shape[0]))
    best = float("inf")
    for round_index in range(rounds + 1):
        began = time.perf_counter()
        for _ in range(calls):
            ops.paged_attention(out, query, caches[0], caches[1], tables, seq_lens, starts, seqs, 0.125, 0, cascade)
        if round_index:  # the first round warms up
            best = min(best, time.perf_counter() - began)
    return best
