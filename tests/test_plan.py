"""``duet plan``: the layouts of a machine's cores, their ranking on ``duet simulate``'s model in
cases with closed-form answers, and the winner written as a config that deploys it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from duet.benchmarks.plan import Layout, evaluate, layouts, main, ranked, write_config
from duet.benchmarks.sim_model import ClusterModel, cluster_model
from duet.benchmarks.workloads import TurnSpec
from duet.cluster.config import parse_args

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PROMPT = {"base_s": 0.002, "per_token_s": 0.001, "per_token_context_s": 1e-6}
DECODE = {"base_s": 0.010, "per_row_s": 0.003, "per_row_context_s": 2e-6}


def _pool(threads: int = 1, max_num_seqs: int = 8) -> dict:
    settings = {"num_blocks": 512, "block_size": 16, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 512, "max_model_len": 2048}
    return {"prompt": {"fit": PROMPT}, "decode": {"fit": DECODE}, "settings": settings, "num_threads": threads, "neighbours": None}


def _profile(threads: int = 1, max_num_seqs: int = 8) -> dict:
    pools = {stage: _pool(threads, max_num_seqs) for stage in ("prefill", "decode", "colocated")}
    return {"machine": {"cpu": "a test CPU", "cores": 4}, "pools": pools}


def _template() -> ClusterModel:
    """A colocated router's settings: prompts from 16 tokens through prefill, no adaptive choice."""
    return ClusterModel(True, [], [], 16, False, 1000, 1.5, 0.2, None)


def test_the_layouts_are_those_whose_threads_fit_the_cores():
    found = layouts(_profile(), {"pd", "colocated"}, 4, [256, 512])
    pools = {(layout.mode, layout.prefill, layout.decode) for layout in found}
    assert pools == {("colocated", 0, k) for k in range(1, 5)} | {
        ("pd", p, d) for p in range(1, 4) for d in range(1, 4) if p + d <= 4
    }
    assert len(found) == 2 * len(pools) and all(layout.cores <= 4 for layout in found)
    assert {layout.budget for layout in found} == {256, 512}
    # Replicas of two threads: half as many fit; PD needs one of each.
    two = layouts(_profile(threads=2), {"pd", "colocated"}, 4, [512])
    assert {(layout.mode, layout.prefill, layout.decode, layout.cores) for layout in two} == {
        ("colocated", 0, 1, 2), ("colocated", 0, 2, 4), ("pd", 1, 1, 4)
    }
    assert layouts(_profile(), {"colocated"}, 0, [512]) == []


def test_a_load_one_replica_serves_one_after_another_ranks_two_replicas_first():
    """One sequence at a time a replica, six requests sent at once: one replica ends the k-th at
    k times a request's time alone, two replicas at half that, so twice the goodput. A single
    request is served as fast by either: a tie, which the one that takes fewer cores wins."""
    profile = _profile(max_num_seqs=1)
    candidates = layouts(profile, {"colocated"}, 2, [512])
    six = [("six", [[TurnSpec([100 + i] * 64, 4)] for i in range(6)], [0.0] * 6)]
    evaluations = [evaluate(layout, _template(), profile, six, (60.0, 60.0), 0.0) for layout in candidates]
    by_replicas = {evaluation["layout"]["decode"]: evaluation for evaluation in evaluations}
    assert by_replicas[2]["goodput"] == pytest.approx(2 * by_replicas[1]["goodput"])
    assert ranked(evaluations)[0]["layout"]["decode"] == 2
    one = [("one", [[TurnSpec([100] * 64, 4)]], [0.0])]
    evaluations = [evaluate(layout, _template(), profile, one, (60.0, 60.0), 0.0) for layout in candidates]
    assert evaluations[0]["goodput"] == pytest.approx(evaluations[1]["goodput"])
    assert ranked(evaluations)[0]["layout"]["cores"] == 1


@pytest.mark.parametrize("template", ["autoscale.yaml", "local-pd.yaml", "colocated.yaml"])
def test_the_winner_is_written_as_a_config_that_deploys_it(template, tmp_path):
    """Its pools at fixed sizes (a template's autoscaling taken out), its budget, the SLO it was
    ranked on; read back as ``duet up`` and ``duet simulate`` read a config."""
    colocated = template == "colocated.yaml"
    layout = Layout("colocated", 0, 3, 1024, 3) if colocated else Layout("pd", 2, 1, 256, 3)
    out = tmp_path / "plan.yaml"
    write_config(str(CONFIGS / template), layout, (900.0, 120.0), "# a header\n", str(out))
    assert out.read_text().startswith("# a header\n")
    import yaml

    config = parse_args(yaml.safe_load(out.read_text())["applications"][0]["args"])
    assert config.mode == ("colocated" if colocated else "pd")
    assert (config.slo.ttft_ms, config.slo.tpot_ms) == (900.0, 120.0)
    assert config.decode.serve_autoscaling("decode") is None and config.decode.starting_replicas("decode") == layout.decode
    assert config.decode.merged_engine(config.engine).max_num_batched_tokens == layout.budget
    if not colocated:
        assert config.prefill.serve_autoscaling("prefill") is None and config.prefill.starting_replicas("prefill") == 2
    model = cluster_model(str(out), _profile())
    assert (len(model.prefill), len(model.decode)) == (layout.prefill, layout.decode)


def test_duet_plan_ranks_every_layout_and_writes_the_first(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(_profile()))
    out, ranking = tmp_path / "plan.yaml", tmp_path / "ranking.json"
    main([
        "--profile", str(profile), "--config", str(CONFIGS / "local-pd.yaml"), "--config", str(CONFIGS / "colocated.yaml"),
        "--cores", "2", "--budgets", "256,512", "--workloads", "random", "--rate", "2,8", "--num-requests", "12",
        "--input-len", "128", "--output-len", "16", "--out", str(out), "--json", str(ranking),
    ])
    evaluations = json.loads(ranking.read_text())
    assert len(evaluations) == 2 * 3  # 1P+1D, one and two colocated replicas, at two budgets
    assert evaluations == ranked(evaluations) and all(evaluation["failed"] == 0 for evaluation in evaluations)
    assert [run["workload"] for run in evaluations[0]["runs"]] == ["random@2/s", "random@8/s"]
    best = Layout(**evaluations[0]["layout"])
    model = cluster_model(str(out), _profile())
    assert model.colocated == (best.mode == "colocated") and len(model.decode) == best.decode
    assert best.name in capsys.readouterr().out
