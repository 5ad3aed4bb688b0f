"""Cascade attention (``kernels/csrc/cascade.h``, ``duet.kernels.cascade``): decode rows that
share a prefix's blocks attend to them once for their group, and get the values the plain
decode kernel gives each row alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from duet.kernels import cpu_ops, cpu_rules
from duet.kernels.cascade import ALWAYS, FIT_SEQS, NEVER, CascadePlanner, CascadeRule, fit_rule, shared_prefixes
from duet.kernels.kv_quant import quantize_rows

BLOCK_SIZE = 16

needs_kernels = pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ CPU kernels do not build here")


def _batch(heads, dtype, kv_dtype, contiguous_prefix: bool, seed: int = 0):
    """Two groups sharing prefixes (5 sequences over 6 blocks, one of them verifying 3 drafts;
    3 sequences over 2 blocks) and two sequences alone, in a cache of random rows."""
    num_heads, num_kv_heads, head_dim = heads
    generator = torch.Generator().manual_seed(seed)
    num_blocks = 64
    rows = torch.randn(2, num_kv_heads, num_blocks, BLOCK_SIZE, head_dim, generator=generator)
    caches = [quantize_rows(r, kv_dtype) if kv_dtype in (torch.int8, torch.float8_e4m3fn) else r.to(kv_dtype) for r in rows]
    order = torch.randperm(num_blocks, generator=generator).tolist()
    prefix_a = list(range(10, 16)) if contiguous_prefix else [order.pop() for _ in range(6)]
    order = [b for b in order if b not in prefix_a]
    prefix_b = [order.pop() for _ in range(2)]
    # (shared blocks, context tokens, query rows)
    seqs = [(prefix_a, 100, 1), (prefix_a, 97, 3), (prefix_a, 120, 1), (prefix_a, 96, 1), (prefix_a, 130, 1),
            (prefix_b, 40, 1), (prefix_b, 33, 1), (prefix_b, 60, 1), ([], 50, 1), ([], 20, 1)]
    tables = torch.zeros(len(seqs), 12, dtype=torch.int32)
    for index, (shared, context, query_len) in enumerate(seqs):
        own = -(-(context + query_len) // BLOCK_SIZE) - len(shared)
        tables[index, : len(shared) + own] = torch.tensor(shared + [order.pop() for _ in range(own)], dtype=torch.int32)
    query_lens = [query_len for _, _, query_len in seqs]
    seq_lens = torch.tensor([context + query_len for _, context, query_len in seqs], dtype=torch.int32)
    starts = torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator).to(dtype)
    groups = [[96, 0, 1, 2, 3, 4], [32, 5, 6, 7]]
    return query, caches, tables, seq_lens, starts, groups


def _attend(query, caches, tables, seq_lens, starts, groups):
    out = torch.empty_like(query)
    cpu_ops.load().paged_attention(out, query, *caches, tables, seq_lens, starts, list(range(len(seq_lens))), 0.125, 0, groups)
    return out


@needs_kernels
@pytest.mark.parametrize("contiguous_prefix", [True, False], ids=["prefix-in-a-run", "prefix-scattered"])
@pytest.mark.parametrize(
    "dtype,kv_dtype,tolerance",
    [
        (torch.float32, torch.float32, 2e-6),
        (torch.bfloat16, torch.bfloat16, 2e-2),
        (torch.float32, torch.int8, 2e-5),  # scores and values in the cache's Hadamard basis
        (torch.float32, torch.float8_e4m3fn, 2e-5),
    ],
    ids=["fp32", "bf16", "int8-cache", "fp8-cache"],
)
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128)], ids=["smollm2-heads", "head-dim-128"])
def test_cascade_gives_each_row_the_plain_kernels_values(heads, dtype, kv_dtype, tolerance, contiguous_prefix):
    query, caches, tables, seq_lens, starts, groups = _batch(heads, dtype, kv_dtype, contiguous_prefix)
    plain = _attend(query, caches, tables, seq_lens, starts, [])
    cascaded = _attend(query, caches, tables, seq_lens, starts, groups)
    # Only the order of additions differs: within a few roundings of the outputs' magnitude.
    torch.testing.assert_close(cascaded.float(), plain.float(), atol=tolerance * float(plain.abs().max()), rtol=tolerance)
    lone = slice(int(starts[8]), None)
    assert torch.equal(cascaded[lone], plain[lone]), "rows outside every group take the plain kernel unchanged"
    if dtype == torch.float32:
        assert not torch.equal(cascaded[: int(starts[8])], plain[: int(starts[8])]), "the groups' rows were summed another way"


@needs_kernels
def test_a_group_whose_sequences_do_not_share_the_prefix_is_refused():
    query, caches, tables, seq_lens, starts, _ = _batch((9, 3, 64), torch.float32, torch.float32, True)
    with pytest.raises(RuntimeError, match="share the prefix's blocks"):
        _attend(query, caches, tables, seq_lens, starts, [[32, 0, 8]])
    with pytest.raises(RuntimeError, match="before its sequences' query rows"):
        _attend(query, caches, tables, seq_lens, starts, [[112, 0, 1, 2, 3, 4]])


def test_shared_prefixes_are_the_leading_blocks_every_member_holds_before_its_query():
    tables = np.array(
        [
            [7, 8, 9, 4, 0],  # 70 tokens of context
            [7, 8, 9, 5, 0],
            [7, 8, 6, 0, 0],  # parts from the others at its third block
            [3, 1, 2, 0, 0],  # alone
            [7, 8, 9, 4, 11],  # a prompt chunk (a long query): the prompt kernel's, not a member
            [3, 1, 0, 0, 0],  # shares block 3 with sequence 3 but holds less than a block before its query
        ],
        dtype=np.int32,
    )
    query_lens = [1, 1, 1, 1, 40, 1]
    seq_lens = [71, 60, 45, 40, 80, 16]
    groups = shared_prefixes(tables, query_lens, seq_lens, BLOCK_SIZE, max_query_len=8)
    assert groups == [(32, [0, 1, 2])]
    assert shared_prefixes(tables[:2], query_lens[:2], seq_lens[:2], BLOCK_SIZE, 8) == [(48, [0, 1])]


def test_the_rule_takes_a_group_by_its_size_and_prefix():
    rule = CascadeRule(seqs=(2, 8, 32), min_prefix_tokens=(1 << 30, 256, 64))
    assert not rule.takes(1, 4096)
    assert not rule.takes(7, 4096)
    assert not rule.takes(8, 128) and rule.takes(8, 256)
    assert rule.takes(40, 64) and not rule.takes(40, 48)
    assert ALWAYS.takes(2, 16)


def test_the_planner_asks_for_its_rule_only_when_a_step_has_a_group():
    fits = []

    def fit():
        fits.append(1)
        return CascadeRule(seqs=(2,), min_prefix_tokens=(64,))

    planner = CascadePlanner("auto", fit)
    alone = np.array([[1, 2, 0], [3, 4, 0]], dtype=np.int32)
    assert planner.groups(alone, [1, 1], [40, 40], BLOCK_SIZE) == [] and not fits
    shared = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]], dtype=np.int32)
    assert planner.groups(shared, [1, 1], [40, 40], BLOCK_SIZE) == []  # 32 shared tokens: under the rule's 64
    assert planner.groups(shared, [1, 1], [70, 70], BLOCK_SIZE) == [[64, 0, 1]]
    assert len(fits) == 2 and planner.num_groups == 1


@needs_kernels
def test_the_measured_rule_names_only_prefixes_of_whole_blocks(tmp_path, monkeypatch):
    """Blocks of 128 tokens: the rule is timed at 128 tokens and past (64 is no whole block, and a
    cascade prefix of it is refused), over an int8 cache. Which lengths win is this CPU's answer.
    The machine's rules file keeps it for the shape: a later process reads it and times nothing."""
    monkeypatch.setenv(cpu_rules.CACHE_ENV, str(tmp_path))
    rule = fit_rule.__wrapped__(cpu_ops.load(), 9, 3, 64, torch.float32, torch.int8, 128)
    assert rule.seqs == FIT_SEQS
    assert all(tokens == NEVER or tokens in (128, 256, 512, 1024, 2048) for tokens in rule.min_prefix_tokens)
    kept = json.loads(cpu_rules.rules_file().read_text())
    [name] = [name for name in kept if name.startswith("cascade_min_prefix_tokens_")]
    assert kept[name] == list(rule.min_prefix_tokens)
    cpu_rules.rules_file().write_text(json.dumps({name: [256, 256, 128, 128, 128]}))
    assert fit_rule.__wrapped__(cpu_ops.load(), 9, 3, 64, torch.float32, torch.int8, 128).min_prefix_tokens == (256, 256, 128, 128, 128)
    other = fit_rule.__wrapped__(cpu_ops.load(), 9, 3, 64, torch.float32, torch.int8, 256)  # another shape: timed
    assert all(tokens == NEVER or tokens in (256, 512, 1024, 2048) for tokens in other.min_prefix_tokens)
