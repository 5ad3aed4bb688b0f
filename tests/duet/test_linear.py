"""Linear's row-count rules: fp32 products go by the float weight's panels up to the rows this CPU
measured them faster; past them a single fp32 row, and a prompt chunk past 128 rows, go to
oneDNN's packed weight only on a CPU where that measured clearly faster than ``F.linear`` (an AMD
EPYC: 8.1 against 5.1 ms for a SmolLM2 step's products at one row, 2.3-2.8x at 256 to 2,048; a
Xeon: ties); GGUF blocks serve fp32 products up to the rows this CPU measured them faster than
the float weights; and every path computes the same product."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from duet.kernels import cpu_ops, cpu_rules
from duet.kernels.gguf import GGUFWeight
from duet.models.linear import Linear
from duet.models.linear_rules import CHUNK_ROWS, FLOAT_PANEL_ROWS, GGUF_FLOAT_ROWS, float_panel_rows, gguf_float_max_rows, packed_wins

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch build")


def test_fp32_products_take_panels_then_onednn_only_where_they_measured_faster():
    linear = Linear(256, 96)
    linear.weight.data = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    linear.pack_for_cpu()
    panel_rows = float_panel_rows()
    assert panel_rows in (0, *FLOAT_PANEL_ROWS) or cpu_ops.load_gguf() is None
    _, _, packed_low, packed_high, *_, plan_panel_rows, _, _, _, _, _, _, _, _ = linear.plan()
    assert plan_panel_rows == (panel_rows if panel_rows > 0 else -1)
    assert packed_low == max(1 if packed_wins(1) else 2, panel_rows + 1)
    assert packed_high == (sys.maxsize if packed_wins(CHUNK_ROWS) else 128)
    assert (linear.packed_weight is None) == (packed_low > packed_high)
    for rows in (1, 2, 130, 600):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(linear(x), F.linear(x, linear.weight), rtol=1e-4, atol=1e-4)
        if rows <= panel_rows:
            assert torch.equal(linear(x), cpu_ops.load_gguf().invariant_linear(x, linear.invariant_panels, 96))
    # No rows (a step of prompt chunks alone asks the LM head for none): every path takes them,
    # a Linear without panels too.
    assert linear(torch.empty(0, 256)).shape == (0, 96)
    bare = Linear(256, 96)
    bare.weight.data = linear.weight.data
    assert bare(torch.empty(0, 256)).shape == (0, 96)


@pytest.mark.skipif(cpu_ops.load_gguf() is None, reason="no C++ toolchain")
def test_gguf_blocks_serve_fp32_products_up_to_the_rows_this_cpu_measured_them_faster():
    ops = cpu_ops.load_gguf()
    limit = gguf_float_max_rows(ops)
    assert limit in (1, *GGUF_FLOAT_ROWS)
    [(codes, scales)] = cpu_ops.sample_q4_1_weights()
    blocks = GGUFWeight(codes, scales, 3, cpu_ops.SAMPLE_IN_FEATURES, ops)
    linear = Linear(cpu_ops.SAMPLE_IN_FEATURES, cpu_ops.SAMPLE_OUT_FEATURES)
    linear.weight.data = blocks.dequantize()
    linear.pack_for_cpu()
    linear.attach_gguf(blocks)
    assert linear.plan()[7] == limit
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(limit, cpu_ops.SAMPLE_IN_FEATURES, generator=generator)
    longer = torch.randn(limit + 1, cpu_ops.SAMPLE_IN_FEATURES, generator=generator)
    assert torch.equal(linear(x), blocks.matmul(x))
    if limit + 1 <= linear.plan()[12]:  # the float weight's panels serve the next rows
        assert torch.equal(linear(longer), ops.invariant_linear(longer, linear.invariant_panels, linear.out_features))
    else:
        assert torch.equal(linear(longer), torch.ops.mkldnn._linear_pointwise(longer, linear.packed_weight, None, "none", [], ""))
    for rows in (x, longer):
        torch.testing.assert_close(linear(rows), F.linear(rows, linear.weight), rtol=1e-4, atol=1e-4)


def test_a_rule_is_measured_once_per_machine_and_thread_count(tmp_path, monkeypatch):
    """``cpu_rules.rule``: the environment's value first, then the rules file's, then the
    measurement, which the file keeps; another thread count reads another file."""
    monkeypatch.delenv(cpu_rules.RULES_ENV, raising=False)
    monkeypatch.setenv(cpu_rules.CACHE_ENV, str(tmp_path))
    timed = []

    def measure(value):
        return lambda: timed.append(value) or value

    assert cpu_rules.rule("some_rule", measure(7)) == 7
    assert cpu_rules.rule("some_rule", measure(9)) == 7  # read, not timed again
    assert cpu_rules.rule("other_rule", measure(3)) == 3
    assert timed == [7, 3]
    [kept] = tmp_path.iterdir()
    assert kept == cpu_rules.rules_file() and json.loads(kept.read_text()) == {"some_rule": 7, "other_rule": 3}
    monkeypatch.setenv(cpu_rules.RULES_ENV, json.dumps({"some_rule": 5}))
    assert cpu_rules.rule("some_rule", measure(9)) == 5 and timed == [7, 3]
    monkeypatch.delenv(cpu_rules.RULES_ENV)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert cpu_rules.rules_file() != kept
        assert cpu_rules.rule("some_rule", measure(8)) == 8 and timed == [7, 3, 8]
    finally:
        torch.set_num_threads(threads)
    assert cpu_rules.rule("some_rule", measure(9)) == 7 and len(list(tmp_path.iterdir())) == 2
    kept.write_text("{not json")  # damaged: measured again and written whole
    assert cpu_rules.rule("some_rule", measure(6)) == 6 and json.loads(kept.read_text()) == {"some_rule": 6}
    assert cpu_rules.remembered("a_set", lambda: {1, 2}) == {1, 2}  # JSON cannot hold it: given, not kept
    assert json.loads(kept.read_text()) == {"some_rule": 6} and not list(tmp_path.glob("*.tmp"))
    monkeypatch.setenv(cpu_rules.CACHE_ENV, "off")
    assert cpu_rules.rules_file() is None and cpu_rules.rule("some_rule", measure(4)) == 4


@pytest.mark.slow  # two new processes, one of them timing the rules: seconds
@pytest.mark.skipif(cpu_ops.load_gguf() is None, reason="no C++ toolchain")
def test_a_new_process_takes_the_rules_this_machine_measured(tmp_path):
    """A replica that a pool adds under load times no rule a process before it measured here: the
    first process writes every rule it timed to the rules file, and the next takes the file's
    values, including ones its own timing would not choose."""
    script = (
        "import json; from duet.kernels import cpu_ops; from duet.models.linear_rules import measured_cpu_rules; "
        "print(json.dumps([measured_cpu_rules(), cpu_ops.load_gguf().panel_min_rows()]))"
    )
    env = {name: value for name, value in os.environ.items() if name != cpu_rules.RULES_ENV} | {cpu_rules.CACHE_ENV: str(tmp_path)}

    def new_process():
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    measured, _ = new_process()
    [kept] = tmp_path.iterdir()
    file_rules = json.loads(kept.read_text())
    assert {name: file_rules[name] for name in measured} == measured
    file_rules |= {"gguf_panel_min_rows": 23, "float_panel_rows": 3, "gguf_float_max_rows": 5}
    kept.write_text(json.dumps(file_rules))
    taken, panel_min_rows = new_process()
    assert taken == {name: file_rules[name] for name in measured} and panel_min_rows == 23


@pytest.mark.slow  # two new processes, one of them timing two rules: seconds
@pytest.mark.skipif(cpu_ops.load_gguf() is None, reason="no C++ toolchain")
def test_rules_given_by_the_environment_are_taken_without_timing():
    """``DUET_CPU_RULES`` (as the tests hand it to Ray's processes): a new process takes each rule
    given, including values its own timing would not choose, and times only the others."""
    given = {"gguf_panel_min_rows": 24, "float_panel_rows": 1, "gguf_float_max_rows": 4}
    if cpu_ops.load_gguf().has_bf16():  # the rows bf16 products read the blocks for
        given["gguf_bf16_max_rows"] = 16
    if cpu_ops.load_gguf().has_amx():  # and on AMX, the rows from which bf16 products go by its tiles
        given["gguf_bf16_amx_min_rows"] = 40
    script = (
        "import json; from duet.kernels import cpu_ops; from duet.models.linear_rules import measured_cpu_rules; "
        "print(json.dumps([measured_cpu_rules(), cpu_ops.load_gguf().panel_min_rows()]))"
    )
    for pinned in (given, {"float_panel_rows": 1}):
        env = {name: value for name, value in os.environ.items() if name != cpu_rules.RULES_ENV} | {
            cpu_rules.RULES_ENV: json.dumps(pinned), cpu_rules.CACHE_ENV: "off"}  # the others timed, not read
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        rules, panel_min_rows = json.loads(run.stdout.strip().splitlines()[-1])
        assert {name: rules[name] for name in pinned} == pinned
        assert panel_min_rows == rules["gguf_panel_min_rows"]
        if pinned is not given:  # the others measured: the values timing chooses from
            assert rules["gguf_panel_min_rows"] in (*cpu_ops.PANEL_ROWS, cpu_ops.NEVER)
            assert rules["gguf_float_max_rows"] in (1, *GGUF_FLOAT_ROWS)
            assert rules.get("gguf_bf16_max_rows", 1) in (1, *GGUF_FLOAT_ROWS)
