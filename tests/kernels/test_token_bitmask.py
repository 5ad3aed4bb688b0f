"""Token bitmasks onto logits: the C++ pass equals the torch reference, bit for bit."""

import pytest
import torch

from duet.kernels import cpu_ops
from duet.kernels.token_bitmask import apply_token_bitmask, unpack


def _bitmask(num_rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    words = torch.randint(-(2**31), 2**31, (num_rows, (vocab + 31) // 32), dtype=torch.int64, generator=generator)
    words[:, ::3] = -1  # whole words allowed: the pass skips them
    words[:, 1::5] = 0  # whole words forbidden
    return words.to(torch.int32)


def test_unpack_reads_bit_t_of_word_t_over_32():
    bitmask = torch.tensor([[0b101, -(2**31)]], dtype=torch.int32)  # tokens 0, 2 and 63
    assert unpack(bitmask, 64).nonzero()[:, 1].tolist() == [0, 2, 63]


@pytest.mark.skipif(cpu_ops.load() is None, reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [49152, 1000])
def test_the_cpu_pass_equals_the_reference(dtype, vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=generator).to(dtype)
    rows = torch.tensor([6, 0, 3, 4])
    bitmask = _bitmask(len(rows), vocab, generator)
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(~unpack(bitmask, vocab), float("-inf"))
    apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)
    assert logits[[1, 2, 5]].isfinite().all()  # rows not named stay as they were


def test_the_torch_path_masks_rows_it_cannot_hand_to_the_cpu_pass():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(1000, 5, generator=generator).t()  # tokens not contiguous: the torch path
    rows = torch.tensor([4, 1])
    bitmask = _bitmask(2, 1000, generator)
    expected = logits.clone()
    apply_token_bitmask(logits, bitmask, rows)
    allowed = unpack(bitmask, 1000)
    assert torch.equal(logits[rows].isinf(), ~allowed)
    assert torch.equal(logits[rows][allowed], expected[rows][allowed])
