"""``duet plan --devices N``: one replica's rate within the SLO is where the planning
autoscaler's replica counts step up, the best PD split of a fleet in closed form, and a
1,000-device plan of roofline profiles at two TP sizes written as a config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from duet.cluster import capacity
from duet.cluster.capacity import Demand
from tests.cluster.test_capacity import model

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_a_replicas_rate_is_where_the_autoscalers_count_steps_up():
    """n replicas take n times one's rate: just under it the autoscaler plans n, just over n + 1."""
    stage = model(num_blocks=2000)
    one = capacity.prefill_rate(stage, 500, 2.0)
    assert one == pytest.approx(2 * 1.1 / (0.5 + 2 * 1.1) / 0.5)  # 1.1 s of the 1.6 s planned left to wait
    decode_one = capacity.decode_rate(stage, 100, 100, 0.02, 0.7)
    colocated_one = capacity.colocated_rate(stage, 100, 100, 2.0, 0.02, 0.7)
    assert 0 < colocated_one < decode_one
    for n in (1, 3, 7):
        assert capacity.prefill_replicas(stage, Demand(n * one * 0.999, 500, 64), 2.0) == n
        assert capacity.prefill_replicas(stage, Demand(n * one * 1.001, 500, 64), 2.0) == n + 1
        assert capacity.decode_replicas(stage, Demand(n * decode_one * 0.999, 100, 100), 0.02, 0.7) == n
        assert capacity.decode_replicas(stage, Demand(n * decode_one * 1.001, 100, 100), 0.02, 0.7) == n + 1
        assert capacity.colocated_replicas(stage, Demand(n * colocated_one * 0.999, 100, 100), 2.0, 0.02, 0.7) == n
        assert capacity.colocated_replicas(stage, Demand(n * colocated_one * 1.001, 100, 100), 2.0, 0.02, 0.7) == n + 1
    assert capacity.prefill_rate(stage, 3000, 2.0) == 0.0  # a prompt alone past the target: nothing within the SLO


def test_the_best_split_feeds_decode_no_more_replicas_than_prefill_passes_on():
    from duet.benchmarks.fleet import PoolRates, best_split

    # 1 req/s a prefill device, 3 a decode one: six prefill and two decode replicas take 6 of 8 devices' worth.
    assert best_split(8, PoolRates(1, 1.0), PoolRates(1, 3.0)) == (6, 2, 6.0)
    # Decode at TP 2 taking 6 req/s: one replica of it matches six of prefill.
    assert best_split(8, PoolRates(1, 1.0), PoolRates(2, 6.0)) == (6, 1, 6.0)
    # 10 devices, the same: 7 + 3 take 7; 8 + 2 would take 6 (decode binds), so fewer devices do not win a lower rate.
    assert best_split(10, PoolRates(1, 1.0), PoolRates(1, 3.0)) == (7, 3, 7.0)
    # Prefill at TP 2 (2 req/s), decode 3: three and two take 6 on 8 devices; four and two would take no more on 10.
    assert best_split(10, PoolRates(2, 2.0), PoolRates(1, 3.0)) == (3, 2, 6.0)
    assert best_split(8, PoolRates(1, 0.0), PoolRates(1, 3.0)) == (0, 0, 0.0)


def test_a_thousand_device_plan_of_two_tp_sizes_is_ranked_and_written_as_a_config(tmp_path, capsys):
    import yaml

    from duet.benchmarks.plan import main as plan
    from duet.benchmarks.profile import main as profile
    from duet.cluster.config import parse_args

    profiles = []
    for tp in (1, 2):
        out = tmp_path / f"h100-tp{tp}.json"
        profile([str(CONFIGS / "local-pd.yaml"), str(CONFIGS / "colocated.yaml"), "--roofline", "h100", "--model-shape", "llama-2-13b",
                 "--tp", str(tp), "--out", str(out)])
        profiles += ["--profile", str(out)]
    ranking, written = tmp_path / "ranking.json", tmp_path / "plan.yaml"
    plan([
        "--devices", "1000", *profiles, "--config", str(CONFIGS / "local-pd.yaml"), "--config", str(CONFIGS / "colocated.yaml"),
        "--budgets", "512,2048", "--workloads", "random", "--input-len", "1024", "--output-len", "256", "--num-requests", "8",
        "--slo-ttft-ms", "400", "--slo-tpot-ms", "40", "--out", str(written), "--json", str(ranking),
    ])
    layouts = json.loads(ranking.read_text())
    # PD: 4 TP pairs, colocated: 2 TP sizes; each at 2 budgets.
    assert len(layouts) == (4 + 2) * 2 and all(layout["devices"] <= 1000 for layout in layouts)
    assert [layout["rate"] for layout in layouts] == sorted((layout["rate"] for layout in layouts), reverse=True)
    best = layouts[0]
    args = yaml.safe_load(written.read_text())["applications"][0]["args"]
    config = parse_args(args)
    if best["mode"] == "pd":
        assert (config.prefill.num_replicas, config.prefill.engine["tensor_parallel_size"]) == (best["prefill"], best["prefill_tp"])
    assert (config.decode.num_replicas, config.decode.engine["tensor_parallel_size"]) == (best["decode"], best["decode_tp"])
    assert config.engine.max_num_batched_tokens == best["budget"] and config.decode.autoscaling_config is None
    assert "planned in" in capsys.readouterr().out
