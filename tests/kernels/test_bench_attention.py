"""``duet bench attention``: both ways it times attend the same cache to the same output, for
float and quantized caches, prompt and decode batches alike (a harness that wrote the cache
wrongly would time a kernel on garbage)."""

from __future__ import annotations

import pytest
import torch

from duet.benchmarks.attention import _layer, measure
from duet.kernels import cpu_ops
from duet.kernels.torch_attention import paged_attention_torch

NATIVE = cpu_ops.load()


@pytest.mark.skipif(NATIVE is None, reason="no C++ toolchain")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (24, 0.5)])
def test_the_kernel_and_the_torch_path_attend_the_benchmarks_layer_alike(cache_dtype, window, softcap):
    generator = torch.Generator().manual_seed(3)
    query, key_cache, value_cache, metadata = _layer([70, 1, 1], [70, 45, 17], (9, 3, 64), torch.float32, cache_dtype, generator)
    options = {"window": window, "softcap": softcap}
    kernel = paged_attention_torch(query, key_cache, value_cache, metadata, 0.125, native_ops=NATIVE, **options)
    reference = paged_attention_torch(query, key_cache, value_cache, metadata, 0.125, **options)
    torch.testing.assert_close(kernel, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(NATIVE is None, reason="no C++ toolchain")
def test_every_case_is_timed_once_per_cache(capsys):
    timings = measure([32], 4, 40, ["float32"], ["auto", "int8"], (4, 2, 64), rounds=1)
    assert [(t.case, t.kv_cache_dtype) for t in timings] == [
        ("prompt 32", "auto"), ("decode 4 x 40", "auto"), ("prompt 32", "int8"), ("decode 4 x 40", "int8"),
    ]
    assert all(t.kernel_ms > 0 and t.torch_ms > 0 for t in timings)
    assert timings[0].gflop == 2 * 4 * 64 * 32 * 33 / 1e9
    assert len(capsys.readouterr().out.splitlines()) == 4  # a line as each is measured
    windowed = measure([32], 4, 40, ["float32"], ["auto"], (4, 2, 64), rounds=1, window=8)
    assert windowed[0].gflop == 4 * 4 * 64 * (sum(range(1, 9)) + 24 * 8) / 1e9 and windowed[1].gflop == 4 * 4 * 64 * 8 * 4 / 1e9
