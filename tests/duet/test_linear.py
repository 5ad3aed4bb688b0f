"""Linear's row-count rule: a single fp32 row goes to oneDNN's packed weight only on a CPU
where that measured clearly faster than ``F.linear`` (an AMD EPYC: 8.1 against 5.1 ms for a
SmolLM2 step's products; a Xeon: a tie), and either path computes the same product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from duet.models.linear import Linear, _packed_wins_one_row

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


def test_one_fp32_row_takes_onednn_only_where_it_measured_faster():
    linear = Linear(256, 96)
    linear.weight.data = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    linear.pack_for_cpu()
    _, _, packed_low, packed_high, *_ = linear.plan()
    assert (packed_low, packed_high) == ((1, 128) if _packed_wins_one_row() else (2, 128))
    assert _packed_wins_one_row() == _packed_wins_one_row()  # measured once: one choice per process
    for rows in (1, 2, 130):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight), rtol=1e-5, atol=1e-5)
