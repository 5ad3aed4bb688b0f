"""The ``duet`` command line says what is true and what to type: a suite's own --help, replicas
that the router would refuse, the size a pool is actually pinned at, the KV cache's dtype, a model
that is not there, and Ray's token authentication on a local cluster. Nothing here starts Ray or
loads a model."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import httpx
import pytest

from duet.cluster import deploy, operate
from duet.cluster.cli import BENCH_SUITES, main, scale_replicas, scaled_message
from duet.cluster.deploy import DeployError
from duet.cluster.operate import format_status, kv_dtype_shown


@pytest.mark.parametrize(
    "argv, usage, own_option",
    [
        (["bench", "offline", "--help"], "usage: duet bench offline", "--peer-python"),
        (["bench", "serve", "--help"], "usage: duet bench serve", "--shared-prefix"),
        (["bench", "soak", "-h"], "usage: duet bench soak", "--kill-every-s"),
        (["eval", "ppl", "--help"], "usage: duet eval ppl", "--settings"),
    ],
)
def test_a_suites_help_is_its_own(capsys, argv, usage, own_option):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith(usage) and own_option in printed
    assert "`duet bench SUITE --help`" not in printed  # not the parent's help


@pytest.mark.parametrize("suite", BENCH_SUITES)
def test_every_suite_names_itself_in_its_usage(capsys, suite):
    with pytest.raises(SystemExit):
        main(["bench", suite, "--help"])
    assert capsys.readouterr().out.startswith(f"usage: duet bench {suite}")


@pytest.mark.parametrize(
    "argv, usage, says",
    [
        (["--help"], "usage: duet [-h]", "bench"),
        (["up", "--help"], "usage: duet up", "configs/local-pd.yaml"),
        (["bench", "--help"], "usage: duet bench", "`duet bench SUITE --help`"),
        (["scale", "--help"], "usage: duet scale", "'auto'"),
    ],
)
def test_duets_own_help_is_still_there(capsys, argv, usage, says):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    assert printed.startswith(usage) and says in printed


def test_a_suite_gets_everything_after_its_name(monkeypatch):
    seen = []

    def suite_main(argv):
        seen.append(list(argv))
        return 3

    monkeypatch.setitem(sys.modules, "duet.benchmarks.step", SimpleNamespace(main=suite_main))
    assert main(["bench", "step", "--batches", "1", "--steps", "2", "--json", "out.json"]) == 3
    assert seen == [["--batches", "1", "--steps", "2", "--json", "out.json"]]


def test_a_missing_suite_is_named(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["bench"])
    assert exited.value.code == 2
    assert "the following arguments are required: suite\n" in capsys.readouterr().err


@pytest.mark.parametrize("replicas", ["0", "-1", "two", "1.5", ""])
def test_scale_refuses_what_the_router_would_with_the_word_to_type(capsys, replicas):
    with pytest.raises(SystemExit) as exited:
        main(["scale", "decode", replicas])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert "duet scale: error: replicas must be a positive number (e.g. 2), or 'auto' to give the pool back to its policy" in error
    assert "null" not in error


def test_scale_replicas():
    assert (scale_replicas("auto"), scale_replicas("AUTO"), scale_replicas("2")) == (None, None, 2)


@pytest.mark.parametrize(
    "replicas, answer, message",
    [
        (5, {"pool": "decode", "pinned": 5, "target": 2, "min_replicas": 1, "max_replicas": 2},
         "the decode pool is pinned at 2 replicas (asked 5; its autoscaling_config allows 1 to 2)"),
        (2, {"pool": "decode", "pinned": 2, "target": 2, "min_replicas": 1, "max_replicas": 4}, "the decode pool is pinned at 2 replicas"),
        (5, {"pool": "decode", "pinned": 5}, "the decode pool is pinned at 5 replicas"),  # a router that gives no bounds
        (None, {"pool": "decode", "pinned": None}, "the decode pool is back with its autoscaling policy"),
    ],
)
def test_scaled_message_says_the_size_the_pool_is_held_at(replicas, answer, message):
    assert scaled_message("decode", replicas, answer) == message


def test_scale_prints_the_routers_answer(capsys, monkeypatch):
    sent = []

    def scale(pool, replicas, url):
        sent.append((pool, replicas, url))
        return {"pool": pool, "pinned": replicas, "target": 2, "min_replicas": 1, "max_replicas": 2}

    monkeypatch.setattr(operate, "scale", scale)
    assert main(["scale", "decode", "5", "--url", "http://127.0.0.1:9"]) == 0
    assert sent == [("decode", 5, "http://127.0.0.1:9")]
    assert capsys.readouterr().out == "the decode pool is pinned at 2 replicas (asked 5; its autoscaling_config allows 1 to 2)\n"


def test_operate_scale_returns_the_answer_and_raises_the_routers_error(monkeypatch):
    answers = iter([
        httpx.Response(200, json={"pool": "decode", "pinned": 5, "target": 2, "min_replicas": 1, "max_replicas": 2}),
        httpx.Response(400, json={"error": {"message": "the decode pool has a fixed size"}}),
        httpx.Response(502, text="Bad Gateway"),
    ])
    monkeypatch.setattr(httpx, "post", lambda *args, **kwargs: next(answers))
    assert operate.scale("decode", 5, "http://127.0.0.1:9")["target"] == 2
    with pytest.raises(DeployError, match="the decode pool has a fixed size"):
        operate.scale("decode", 5, "http://127.0.0.1:9")
    with pytest.raises(DeployError, match="HTTP 502 from http://127.0.0.1:9/duet/scale: Bad Gateway"):
        operate.scale("decode", 5, "http://127.0.0.1:9")


def test_status_says_the_routers_refusal_not_that_nothing_answers(monkeypatch):
    refusal = httpx.Response(401, json={"error": {"message": "missing or wrong admin key"}})
    monkeypatch.setattr(httpx, "get", lambda *args, **kwargs: refusal)
    with pytest.raises(DeployError, match="^missing or wrong admin key$"):
        operate.status("http://127.0.0.1:9")


@pytest.mark.parametrize(
    "stats, shown",
    [
        ({"kv_cache_dtype": "auto", "kv_dtype": "bfloat16"}, "bfloat16"),
        ({"kv_cache_dtype": "fp8", "kv_dtype": "float8_e4m3fn"}, "fp8_e4m3"),
        ({"kv_cache_dtype": "int8", "kv_dtype": "int8"}, "int8"),
        ({"kv_cache_dtype": "auto"}, "as model"),  # a replica that reports only the setting
        ({"kv_cache_dtype": "int8"}, "int8"),
    ],
)
def test_status_shows_the_kv_caches_dtype_not_its_setting(stats, shown):
    assert kv_dtype_shown(stats) == shown


def test_status_table_has_the_dtype_in_its_column():
    stats = {
        "stage": "prefill", "replica_id": "abc", "num_running": 1, "num_waiting": 0, "kv_usage": 0.5, "num_free_blocks": 5, "num_blocks": 10,
        "kv_cache_dtype": "auto", "kv_dtype": "float32", "transfers": 0, "num_preemptions": 0, "age_s": 0.1,
        "integrity_failures": 0, "threads": 2, "shared_cores": True,
    }
    report = {
        "url": "http://127.0.0.1:8000", "model": "smollm2",
        "pools": {"decode": {"replicas": 1, "stats": [stats]}},
        "admission": {"running_sequences": 1, "queued_requests": 0},
    }
    header, row = format_status(report).splitlines()[1:3]
    column = header.index("kv dtype")
    assert row[column - 1:column + len("kv dtype")].strip() == "float32"
    assert "auto" not in row
    assert row.endswith("2 shared") and header.endswith("cores")  # each replica's cores, and whether it takes turns at all of them
    role = header.index("role")
    assert row[role:role + 8].strip() == "prefill"  # the role it serves now, here away from its decode pool


def test_chat_with_a_model_that_is_not_there_says_what_to_type(capsys, tmp_path):
    assert main(["chat", "--model", str(tmp_path / "missing"), "hi"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert error.startswith(f"duet chat: model '{tmp_path / 'missing'}' is not a known alias")
    assert "--model smollm2" in error and "Hugging Face model directory" in error


def test_chat_with_a_model_duet_does_not_run_names_its_architecture(capsys, tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    assert main(["chat", "--model", str(tmp_path), "hi"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "Traceback" not in error
    assert "architecture ['GPT2LMHeadModel'] is not supported; duet runs LlamaForCausalLM" in error


@pytest.fixture
def ray_auth_env(monkeypatch, tmp_path):
    """No ray imported yet, no mode set, and the token (if any) in tmp_path/auth_token."""
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        # Set, then deleted, so that monkeypatch restores the value (or the absence) whatever the
        # test sets: a delenv of an absent name records nothing, and a RAY_AUTH_MODE=token set by
        # the test once leaked into the later tests' ray.init, whose GCS then refused them.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "auth_token"))
    return tmp_path / "auth_token"


def test_a_token_ray_would_use_anyway_is_said_in_ray_auth_mode(ray_auth_env):
    """Ray turns token auth on where a token exists and warns in every process; saying so is silent."""
    ray_auth_env.write_text("secret")
    deploy._settle_ray_auth_mode()
    assert deploy.os.environ["RAY_AUTH_MODE"] == "token" and deploy.ray_token_auth_on()


def test_without_a_token_ray_decides(ray_auth_env):
    deploy._settle_ray_auth_mode()
    assert "RAY_AUTH_MODE" not in deploy.os.environ and not deploy.ray_token_auth_on()


def test_a_mode_the_user_set_is_theirs(ray_auth_env, monkeypatch):
    ray_auth_env.write_text("secret")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    deploy._settle_ray_auth_mode()
    assert deploy.os.environ["RAY_AUTH_MODE"] == "disabled" and not deploy.ray_token_auth_on()


def test_ray_auth_mode_is_left_alone_once_ray_is_imported(ray_auth_env, monkeypatch):
    """Ray read its mode when imported: one set later would not be this process's."""
    ray_auth_env.write_text("secret")
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace())
    deploy._settle_ray_auth_mode()
    assert "RAY_AUTH_MODE" not in deploy.os.environ


def test_the_cli_imports_no_ray_before_duet_up_sets_the_loopback_variable():
    """Guards `duet up` on a local cluster: Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when
    imported, so the CLI and what it imports to start must not import ray first (an import of
    Serve's request router at the top of the internals module once made every `duet up` refuse)."""
    import subprocess

    code = "import sys, duet.cluster.cli, duet.cluster.deploy; print('ray' in sys.modules)"
    answer = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert answer.stdout.strip() == "False", answer.stderr


def test_status_shows_a_replicas_second_kv_tier_its_adapters_and_its_sends_rate_where_it_has_them():
    stats = {
        "stage": "prefill", "replica_id": "abc", "num_running": 0, "num_waiting": 0, "kv_usage": 0.5, "num_free_blocks": 5, "num_blocks": 10,
        "kv_cache_dtype": "auto", "kv_dtype": "float32", "transfers": 0, "num_preemptions": 0, "age_s": 0.1,
        "integrity_failures": 0, "threads": 1, "shared_cores": False,
        "tier_capacity_blocks": 1000, "tier_blocks": 250, "tier_saved_blocks": 300, "tier_restored_blocks": 40,
    }
    report = {"url": "u", "model": "m", "pools": {"prefill": {"replicas": 1, "stats": [stats]}},
              "admission": {"running_sequences": 0, "queued_requests": 0}}
    assert format_status(report).splitlines()[2].endswith("tier: 250/1000 blocks, 40 restored")
    stats["tier_capacity_blocks"] = 0
    assert "tier" not in format_status(report).splitlines()[2]
    stats |= {"loras": ["sql", "chat"], "lora_loads": 5, "lora_evictions": 3}  # and the LoRA adapters it holds
    assert format_status(report).splitlines()[2].endswith("LoRA: sql, chat (5 loaded, 3 evicted)")
    stats |= {"transfer_wire_bytes": 70_778_880, "transfer_wire_seconds": 0.446}  # and what its sends moved a second
    assert format_status(report).splitlines()[2].endswith("evicted)  sends: 159 MB/s")
    stats |= {"transfer_wire_bytes": 4_700_000_000, "transfer_wire_seconds": 2.0}
    assert format_status(report).splitlines()[2].endswith("sends: 2.35 GB/s")


def test_ray_is_started_under_the_interpreter_that_runs_duet():
    """Guards a cluster whose workers ran another Python: `duet up` took the `ray` script first on
    PATH when its own environment had none, and that interpreter's duet was another tree."""
    import subprocess

    command = deploy.ray_cli()
    assert command[0] == sys.executable
    completed = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0 and "version" in completed.stdout, completed.stderr


def test_status_shows_what_a_pool_sized_ahead_planned_for():
    import time

    decision = {"running": 1, "target": 2, "reason": "planned", "at": time.time(),
                "numbers": {"planned": 2, "rate": 1.25, "prompt_tokens": 512.4, "output_tokens": 127.6, "correction": 1.5}}
    report = {"url": "u", "model": "m", "pools": {"decode": {"replicas": 1, "stats": [], "autoscaler": decision}},
              "admission": {"running_sequences": 0, "queued_requests": 0}}
    line = next(line for line in format_status(report).splitlines() if line.startswith("decode pool"))
    assert line.endswith("planned 2 for 1.25 req/s of 512 + 128 tokens (profile's times x1.5)")
    del decision["numbers"]["planned"]  # a reactive decision: nothing planned to show
    assert "planned" not in next(line for line in format_status(report).splitlines() if line.startswith("decode pool")).split(")")[-1]
