"""Roofline profiles (``duet profile --roofline``) on cases with closed-form answers: a decode
step of one sequence reads the weights once, a long prompt is bound by its arithmetic, TP splits
both and adds its all-reduces, a MoE reads the experts its rows reach, the KV cache is what the
device's memory holds beside the weights; and the profile is one ``duet simulate`` and ``duet
plan`` run on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from duet.benchmarks.roofline import DEVICES, SHAPES, Device, ModelShape, Roofline, model_shape

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
H100 = DEVICES["h100"]
LLAMA_7B = model_shape("llama-2-7b")


def _weights(shape: ModelShape) -> float:
    """A dense Llama's bytes in bf16 (q/k/v/o square: as many key-value heads as heads)."""
    attention = 4 * shape.hidden * shape.hidden
    mlp = 3 * shape.hidden * shape.intermediate
    return (shape.layers * (attention + mlp) + 2 * shape.vocab * shape.hidden) * 2


def test_the_shapes_weigh_what_the_models_do():
    assert _weights(LLAMA_7B) == LLAMA_7B.weight_bytes
    assert LLAMA_7B.weight_bytes / 2 == pytest.approx(6.74e9, rel=0.01)
    assert model_shape("llama-2-70b").weight_bytes / 2 == pytest.approx(69.0e9, rel=0.01)
    mixtral = model_shape("mixtral-8x7b")
    assert mixtral.weight_bytes / 2 == pytest.approx(46.7e9, rel=0.01)
    assert mixtral.active_params() + 2 * mixtral.vocab * mixtral.hidden == pytest.approx(12.9e9, rel=0.01)
    assert LLAMA_7B.kv_bytes_per_token == 2 * 32 * 4096 * 2  # keys and values, every layer, bf16


def test_a_decode_step_of_one_sequence_reads_the_weights_once_and_its_kv():
    roofline = Roofline(LLAMA_7B, H100)
    read = (LLAMA_7B.weight_bytes - LLAMA_7B.vocab * LLAMA_7B.hidden * 2) + 500 * LLAMA_7B.kv_bytes_per_token  # no embedding table read
    expected = read / (H100.bandwidth * H100.memory_efficiency) + H100.step_overhead_s
    assert roofline.decode_seconds(1, 500) == pytest.approx(expected)
    assert roofline.decode_seconds(8, 8 * 500) > roofline.decode_seconds(1, 500)  # more KV read


def test_a_long_prompt_is_bound_by_its_arithmetic():
    roofline = Roofline(LLAMA_7B, H100)
    tokens = 8192
    flops = 2 * LLAMA_7B.active_params() * tokens + 2 * LLAMA_7B.vocab * LLAMA_7B.hidden
    flops += 4 * LLAMA_7B.layers * LLAMA_7B.heads * LLAMA_7B.head_dim * tokens * tokens / 2
    expected = flops / (H100.flops * H100.compute_efficiency) + H100.step_overhead_s
    assert roofline.prompt_seconds(tokens, 0) == pytest.approx(expected)
    short = (LLAMA_7B.weights_read(16) + 16 * LLAMA_7B.kv_bytes_per_token) / (H100.bandwidth * H100.memory_efficiency)
    assert roofline.prompt_seconds(16, 0) == pytest.approx(short + H100.step_overhead_s)  # a short one waits on memory


def test_tensor_parallelism_splits_the_work_adds_its_all_reduces_and_frees_memory_for_kv():
    one, two = Roofline(LLAMA_7B, H100), Roofline(LLAMA_7B, H100, tp=2)
    overhead = H100.step_overhead_s
    reduce = 2 * LLAMA_7B.layers * (LLAMA_7B.hidden * 2 * 2 * 1 / 2 / H100.link_bandwidth + H100.link_latency_s)  # one row
    assert two.decode_seconds(1, 100) == pytest.approx((one.decode_seconds(1, 100) - overhead) / 2 + reduce + overhead)
    free_one = H100.memory_bytes * H100.memory_fraction - LLAMA_7B.weight_bytes
    free_two = H100.memory_bytes * H100.memory_fraction - LLAMA_7B.weight_bytes / 2
    assert one.num_blocks(16) == int(free_one // (16 * LLAMA_7B.kv_bytes_per_token))
    assert two.num_blocks(16) == int(free_two // (16 * LLAMA_7B.kv_bytes_per_token / 2))
    with pytest.raises(SystemExit, match="leave no room for a KV cache"):
        Roofline(model_shape("llama-2-70b"), H100).num_blocks(16)


def test_a_mixture_of_experts_reads_the_experts_its_rows_reach():
    mixtral = model_shape("mixtral-8x7b")
    head = mixtral.vocab * mixtral.hidden * 2
    attention = mixtral.layers * mixtral.attention_params * 2
    expert = mixtral.layers * mixtral.expert_params * 2
    assert mixtral.weights_read(1) == pytest.approx(attention + 2 * expert + head)  # its top two
    assert mixtral.weights_read(256) == pytest.approx(attention + 8 * expert + head, rel=1e-6)  # all of them


def test_a_config_json_gives_the_same_shape_as_its_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["llama-3.1-8b"] | {"architectures": ["LlamaForCausalLM"]}))
    assert model_shape(str(tmp_path)) == model_shape("llama-3.1-8b")
    with pytest.raises(SystemExit, match="neither a preset"):
        model_shape(str(tmp_path / "absent.json"))


def test_duet_profile_roofline_writes_a_profile_that_simulate_and_plan_run_on(tmp_path, capsys):
    from duet.benchmarks.plan import main as plan
    from duet.benchmarks.profile import main as profile
    from duet.benchmarks.sim_model import PoolModel

    out = tmp_path / "h100.json"
    profile([str(CONFIGS / "local-pd.yaml"), str(CONFIGS / "colocated.yaml"), "--roofline", "h100", "--model-shape", "llama-2-7b", "--out", str(out)])
    written = json.loads(out.read_text())
    assert set(written["pools"]) == {"prefill", "decode", "colocated"} and written["machine"]["cores"] == 8
    roofline = Roofline(LLAMA_7B, H100)
    decode = PoolModel.from_profile(written["pools"]["decode"])
    # The fitted decode step is the roofline's where memory binds it (up to its batch of 32).
    for rows, context in ((1, 64), (8, 8 * 1024), (32, 32 * 256)):
        assert decode.step_seconds(0, 0, rows, context) == pytest.approx(roofline.decode_seconds(rows, context), rel=0.02)
    assert written["pools"]["decode"]["settings"]["num_blocks"] == roofline.num_blocks(16)
    # Prompt steps are the roofline's both where the weights' reading binds and where the arithmetic does.
    prefill = PoolModel.from_profile(written["pools"]["prefill"])
    for tokens, cached in ((16, 0), (64, 256), (512, 0), (512, 1024)):
        work = tokens * (cached + tokens / 2)
        assert prefill.step_seconds(tokens, work, 0, 0) == pytest.approx(roofline.prompt_seconds(tokens, cached), rel=0.03), (tokens, cached)
    assert written["transfer"]["fit"]["per_token_s"] == pytest.approx(LLAMA_7B.kv_bytes_per_token / H100.link_bandwidth)
    ranking = tmp_path / "ranking.json"
    plan([
        "--profile", str(out), "--config", str(CONFIGS / "local-pd.yaml"), "--config", str(CONFIGS / "colocated.yaml"),
        "--cores", "2", "--budgets", "512", "--workloads", "random", "--rate", "4", "--num-requests", "16",
        "--input-len", "256", "--output-len", "16", "--out", str(tmp_path / "plan.yaml"), "--json", str(ranking),
    ])
    evaluations = json.loads(ranking.read_text())
    assert len(evaluations) == 3 and all(evaluation["failed"] == 0 for evaluation in evaluations)
    # 16 requests at 4 req/s on an H100 all meet bench serve's default SLOs: every one counts
    assert all(run["slo_attainment"] == 1.0 for evaluation in evaluations for run in evaluation["runs"])
    assert "NVIDIA H100" in capsys.readouterr().out


def test_a_device_is_a_preset_with_figures_changed_or_figures_alone():
    from duet.benchmarks.roofline import device_from

    assert device_from("h100", None, 4.8e12, None, None).bandwidth == 4.8e12
    cpu = device_from("cpu-node", 2e12, 300e9, 512, 25e9)
    assert cpu == Device("cpu-node (roofline)", 2e12, 300e9, 512 * 2**30, 25e9)
    with pytest.raises(SystemExit, match="every figure"):
        device_from("cpu-node", 2e12, None, 512, 25e9)
