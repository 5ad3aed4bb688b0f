"""Linear's row-count rule: a single fp32 row, and a prompt chunk past 128 rows, go to oneDNN's
packed weight only on a CPU where that measured clearly faster than ``F.linear`` (an AMD EPYC:
8.1 against 5.1 ms for a SmolLM2 step's products at one row, 2.3-2.8x at 256 to 2,048; a Xeon:
ties), and either path computes the same product."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from duet.models.linear import _CHUNK_ROWS, Linear, _packed_wins

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


def test_one_fp32_row_and_long_chunks_take_onednn_only_where_it_measured_faster():
    linear = Linear(256, 96)
    linear.weight.data = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    linear.pack_for_cpu()
    _, _, packed_low, packed_high, *_ = linear.plan()
    assert packed_low == (1 if _packed_wins(1) else 2)
    assert packed_high == (sys.maxsize if _packed_wins(_CHUNK_ROWS) else 128)
    for rows in (1, 2, 130, 600):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight), rtol=1e-4, atol=1e-4)
