"""``duet eval ppl`` on SmolLM2: each quantized setting stays within its perplexity budget of
fp32 on the project's own text, and reports the memory it saves."""

from __future__ import annotations

import pytest

from duet.benchmarks.perplexity import prefix_share, report, run
from duet.kernels import cpu_ops

pytestmark = [pytest.mark.slow, pytest.mark.skipif(cpu_ops.load_gguf() is None, reason="no C++ toolchain")]

BUDGETS = {"kv-int8": 0.02, "kv-fp8": 0.03, "w-int8": 0.02, "w-int4": 0.10, "tier-int8": 0.02}


def test_quantized_settings_stay_within_their_perplexity_budgets(smollm2_dir):
    # Greedy agreement on 4 of the 16 chat prompts: the budgets are perplexity's and top-1's.
    results = {result.setting: result for result in run("smollm2", ["fp32", *BUDGETS], num_prompts=4)}
    print(report(list(results.values())))
    fp32 = results["fp32"]
    assert fp32.change == 0 and fp32.kl_divergence == 0 and fp32.top1_agreement == 1 and fp32.greedy_agreement == 1
    for setting, budget in BUDGETS.items():
        assert results[setting].change <= budget, (setting, results[setting])
        assert results[setting].top1_agreement >= 0.75, (setting, results[setting])
    assert results["kv-int8"].top1_agreement >= 0.9
    assert fp32.kv_bytes_per_token / results["kv-int8"].kv_bytes_per_token == pytest.approx(256 / 65)
    # The int8 tier's rows are the int8 cache's: every chunk's history through it costs no more.
    assert results["tier-int8"].kl_divergence <= 1.5 * results["kv-int8"].kl_divergence and results["tier-int8"].greedy_agreement is None
    assert results["w-int8"].weight_bytes < fp32.weight_bytes / 3 and results["w-int4"].weight_bytes < results["w-int8"].weight_bytes


def test_prefix_share_counts_each_sequence_up_to_its_first_difference():
    assert prefix_share([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]]) == 4 / 6
