"""``duet bench pull`` on the tiny Llama: one round of both ways, the turn's greedy tokens the
same both ways, every figure it reports present (no verdict on speed)."""

from __future__ import annotations

import json

import pytest

from duet.benchmarks import pull

pytestmark = pytest.mark.slow  # an engine in a process of its own


def test_one_round_serves_the_turn_both_ways_with_the_same_tokens(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "pull.json"
    argv = ["--model", str(tiny_llama_dir), "--history", "40", "--new", "20", "--streams", "2", "--rounds", "1", "--json", str(out)]
    assert pull.main(argv) == 0
    runs = json.loads(out.read_text())
    assert [run["mode"] for run in runs] == ["send", "pull"]
    assert runs[0]["tokens"] == runs[1]["tokens"] and len(runs[0]["tokens"]) == pull.TURN_TOKENS
    assert all(run["ttft_ms"] > 0 and run["longest_step_ms"] >= run["median_step_ms"] > 0 for run in runs)
    assert "the same 8 greedy tokens both ways: True" in capsys.readouterr().out
