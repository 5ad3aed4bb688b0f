"""Config files: the shipped ones are valid; mistakes get one readable line each."""

from __future__ import annotations

from pathlib import Path

import pytest

from duet.cluster.config import AppConfigError, EngineSettings, PoolSettings, parse_args
from duet.cluster.deploy import DeployError, ServeFile

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["local-pd.yaml", "colocated.yaml", "autoscale.yaml", "cluster-example.yaml", "tp2-pd.yaml"])
def test_shipped_configs_are_valid_serve_configs(name):
    serve_file = ServeFile.read(CONFIGS / name)
    assert serve_file.applications[0]["import_path"] == "duet.cluster.app:build_app"
    assert serve_file.applications[0]["args"]["model_id"] == "smollm2"


def test_local_configs_listen_on_loopback_only():
    for name in ("local-pd.yaml", "colocated.yaml", "autoscale.yaml", "tp2-pd.yaml"):
        serve_file = ServeFile.read(CONFIGS / name)
        assert (serve_file.host, serve_file.url(serve_file.applications[0])) == ("127.0.0.1", "http://127.0.0.1:8000")


@pytest.mark.parametrize(
    "args, message",
    [
        ({"modle": "smollm2"}, "modle: unknown setting"),
        ({"decode": {"num_replica": 2}}, "decode.num_replica: unknown setting"),
        ({"mode": "colocated", "prefill": {}}, "mode 'colocated' has no prefill pool"),
        ({"mode": "both"}, "mode: Input should be 'pd' or 'colocated'"),
        ({"engine": {"block_size": 12}}, "block_size must be a power of two"),
        ({"prefill": {"engine": {"dtyp": "float32"}}}, "prefill.engine:"),
        ({"decode": {"on_transfer_failure": "retry"}}, "decode.on_transfer_failure"),
        (
            {"decode": {"engine": {"speculative_config": {"method": "medusa", "num_speculative_tokens": 3}}}},
            "decode.engine: speculative_config.method='medusa': use one of ngram, draft_model, layer_skip",
        ),
        (
            {"decode": {"engine": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "k": 2}}}},
            "speculative_config: unknown settings ['k']",
        ),
        (
            {"prefill": {"engine": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}}},
            "speculation runs where tokens are decoded; set it under decode.engine",
        ),
        ({"decode": {"num_replicas": 2, "autoscaling_config": {}}}, "num_replicas and autoscaling_config exclude each other"),
        ({"decode": {"autoscaling_config": {"policy": {"policy_function": "x:y"}}}}, "duet sets the policy of its pools"),
        ({"decode": {"autoscaling_config": {"prompt_tokens_per_replica": 100}}}, "unknown setting prompt_tokens_per_replica"),
        ({"prefill": {"autoscaling_config": {"kv_usage": 0.5}}}, "unknown setting kv_usage"),
        ({"decode": {"autoscaling_config": {"kv_usage": 1.5}}}, "autoscaling_config: kv_usage=1.5 is out of range"),
        ({"decode": {"autoscaling_config": {"min_replicas": 3, "max_replicas": 2}}}, "autoscaling_config:"),
        ({"slo": {"ttft_ms": 0}}, "slo.ttft_ms"),
        ({"router": {"max_migrations": -1}}, "router.max_migrations"),
        ({"engine": {"kv_offload": {"tier": "disk", "path": "/nonexistent/tier"}}}, "kv_offload.path='/nonexistent/tier' is not a folder"),
        ({"prefill": {"engine": {"kv_offload": {"size_gib": 1 << 20}}}}, "prefill.engine: kv_offload.size_gib=1048576 does not fit"),
        ({"engine": {"kv_offload": {"tier": "cpu", "size_gib": 1, "path": "/tmp"}}}, "kv_offload.path (a folder for the tier's file)"),
        ({"engine": {"kv_offload": {}, "enable_prefix_caching": False}}, "kv_offload keeps blocks the prefix cache evicts"),
    ],
)
def test_bad_args_fail_with_a_readable_message(args, message):
    with pytest.raises(AppConfigError) as error:
        parse_args(args)
    assert message in str(error.value)


def test_a_pools_autoscaling_config_splits_into_serves_settings_and_its_policys_targets():
    config = parse_args({
        "slo": {"ttft_ms": 1500, "tpot_ms": 100},
        "decode": {"autoscaling_config": {"max_replicas": 4, "kv_usage": 0.6, "cooldown_s": 5}},
    })
    serve = config.decode.serve_autoscaling("decode")
    assert serve["max_replicas"] == 4 and serve["min_replicas"] == 1 and "kv_usage" not in serve
    assert config.decode.policy_targets("decode", config.slo) == {"ttft_s": 1.5, "tpot_s": 0.1, "kv_usage": 0.6, "cooldown_s": 5}
    assert config.prefill.serve_autoscaling("prefill") is None  # a fixed pool


def test_pd_mode_gets_a_default_prefill_pool_and_pool_overrides_merge():
    config = parse_args({"engine": {"max_num_seqs": 8}, "decode": {"engine": {"max_num_seqs": 4}}})
    assert config.prefill is not None
    assert config.prefill.merged_engine(config.engine).max_num_seqs == 8
    assert config.decode.merged_engine(config.engine).max_num_seqs == 4


def test_a_file_without_applications_is_refused(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("http_options: {port: 8000}\n")
    with pytest.raises(DeployError, match="applications"):
        ServeFile.read(path)


APP = "{import_path: duet.cluster.app:build_app"


@pytest.mark.parametrize(
    "text, message",
    [
        (f"router: {{reasoning_parser: think}}\napplications:\n  - {APP}}}\n", "router is not a key of Serve's config; duet's 'router' goes under applications[i].args"),
        (f"http_option: {{port: 8000}}\napplications:\n  - {APP}}}\n", "http_option is not a key of Serve's config; Serve's keys here: applications, "),
        (f"applications:\n  - {APP}, engine: {{dtype: float32}}}}\n", "applications[0].engine is not a key of Serve's config; duet's 'engine' goes under"),
        (f"applications:\n  - {APP}, arg: {{}}}}\n", "applications[0].arg is not a key of Serve's config; Serve's keys here: args, "),
        ("applications:\n  - duet.cluster.app:build_app\n", "applications[0] must be a mapping"),  # not an AttributeError
    ],
)
def test_a_key_serve_would_drop_is_refused_naming_where_it_belongs(tmp_path, text, message):
    """Serve's schema ignores keys it does not have: a section meant for ``args`` was dropped."""
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(DeployError) as refused:
        ServeFile.read(path)
    assert f"{path}: {message}" in str(refused.value)


@pytest.mark.parametrize(
    "second, kind", [("{import_path: duet.cluster.app:build_app, route_prefix: /b}", "name"), ("{name: b, import_path: duet.cluster.app:build_app}", "route_prefix")]
)
def test_applications_sharing_a_name_or_a_route_are_refused(tmp_path, second, kind):
    """As Serve's schema refuses them: deployed one after the other, the second replaced the first."""
    path = tmp_path / "twice.yaml"
    path.write_text(f"applications:\n  - {{import_path: duet.cluster.app:build_app}}\n  - {second}\n")
    with pytest.raises(DeployError, match=f"two applications have the same {kind}"):
        ServeFile.read(path)


@pytest.mark.parametrize("name", ["local-pd.yaml", "colocated.yaml", "autoscale.yaml", "cluster-example.yaml", "tp2-pd.yaml"])
def test_shipped_configs_pass_serves_own_schema(name):
    """So that `serve deploy` accepts them as they are."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(yaml.safe_load((CONFIGS / name).read_text()))


def test_duet_up_exits_non_zero_with_the_reason_before_touching_ray(tmp_path, capsys):
    from duet.cluster.cli import main

    path = tmp_path / "typo.yaml"
    path.write_text(
        "applications:\n  - name: duet\n    import_path: duet.cluster.app:build_app\n"
        "    args: {model_id: smollm2, decode: {num_replica: 2}}\n"
    )
    assert main(["up", str(path)]) == 1
    assert "decode.num_replica: unknown setting" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"decode": {"engine": {"block_size": 32}}}, "prefill.engine.block_size=16 but decode.engine.block_size=32"),
        ({"prefill": {"engine": {"dtype": "bfloat16"}}}, "prefill.engine.dtype=bfloat16 but decode.engine.dtype=float32"),
    ],
)
def test_pools_that_could_not_exchange_kv_are_refused_at_deploy_time(args, message):
    """Guards the silent failure: a block_size or dtype mismatch showed up only at the first
    transfer, and the recompute policy then prefilled every prompt on the decode pool."""
    with pytest.raises(AppConfigError) as error:
        parse_args(args)
    assert message in str(error.value) and "the pools exchange KV blocks" in str(error.value)


def test_pools_with_different_lora_adapters_are_refused_at_deploy_time(tmp_path):
    """A prompt's KV is computed with its adapter on the prefill pool: both pools must hold it."""
    (tmp_path / "sql").mkdir()
    (tmp_path / "sql" / "adapter_config.json").write_text("{}")
    with pytest.raises(AppConfigError) as error:
        parse_args({"decode": {"engine": {"lora_modules": {"sql": str(tmp_path / "sql")}}}})
    assert "prefill.engine.lora_modules={} but decode.engine.lora_modules=" in str(error.value)
    with pytest.raises(AppConfigError, match="lora_modules.sql: no PEFT adapter at"):
        parse_args({"engine": {"lora_modules": {"sql": str(tmp_path / "missing")}}})


def test_engine_settings_are_the_engines_own_fields_and_defaults():
    from dataclasses import fields

    from duet.cluster.config import EngineSettings
    from duet.config import EngineArgs

    engine_fields = {f.name: f.default for f in fields(EngineArgs) if f.name not in ("model", "kv_transfer_config")}
    settings = EngineSettings()
    assert {name: getattr(settings, name) for name in engine_fields} == engine_fields


def test_a_tensor_parallel_pool_gets_a_bundle_for_its_replica_and_one_per_worker():
    pool = PoolSettings(ray_actor_options={"num_cpus": 0}, worker_num_cpus=0.5)
    engine = EngineSettings(tensor_parallel_size=2)
    assert pool.placement_group_bundles(engine) == [{"CPU": 0.01}, {"CPU": 0.5}, {"CPU": 0.5}]
    assert pool.resources("decode", engine) == pytest.approx({"CPU": 1.01, "GPU": 0.0})
    assert pool.placement_group_bundles(EngineSettings()) is None


class _Replica:
    pass


def test_a_tensor_parallel_replica_keeps_its_node_constraints_in_its_bundles():
    """Serve places the replica's actor in its group's first bundle: that bundle asks for the
    actor's custom resources (Serve refuses a group otherwise), and every bundle takes the
    replica's label selector, so that its workers run on the nodes it may run on
    (``tests/integration/test_multinode.py`` deploys one)."""
    from ray import serve

    options = {"num_cpus": 0.2, "resources": {"fast_disk": 1}, "label_selector": {"duet-pool": "prefill"}}
    pool = PoolSettings(ray_actor_options=options, worker_num_cpus=0.6)
    engine = EngineSettings(tensor_parallel_size=2)
    assert pool.placement_group_bundles(engine) == [{"CPU": 0.2, "fast_disk": 1.0}, {"CPU": 0.6}, {"CPU": 0.6}]
    assert pool.bundle_label_selector(engine) == [{"duet-pool": "prefill"}] * 3
    serve.deployment(name="prefill")(_Replica).options(  # Serve checks the group as it deploys it
        ray_actor_options=options, placement_group_bundles=pool.placement_group_bundles(engine),
        placement_group_bundle_label_selector=pool.bundle_label_selector(engine),
    )
    with pytest.raises(ValueError, match="fast_disk"):
        serve.deployment(name="prefill")(_Replica).options(ray_actor_options=options, placement_group_bundles=[{"CPU": 0.2}, {"CPU": 0.6}])
    assert pool.bundle_label_selector(EngineSettings()) is None  # one process: the actor's own selector places it


def test_a_layout_that_cannot_split_the_heads_is_refused_before_any_actor_starts(tiny_llama_dir):
    from duet.cluster.app import build_app

    with pytest.raises(AppConfigError, match="decode.engine: tensor_parallel_size=3 cannot split 4"):
        build_app({"model": str(tiny_llama_dir), "mode": "colocated", "engine": {"tensor_parallel_size": 3}})


def test_a_prefill_pool_with_a_shorter_context_than_decode_is_refused(tiny_llama_dir):
    """Guards every request between the two lengths: the router fits prompts to the decode pool's
    context, and the prefill replicas refused them with a 400 at run time."""
    from duet.cluster.app import build_app

    args = {"model": str(tiny_llama_dir), "engine": {"max_model_len": 512}}
    with pytest.raises(AppConfigError, match="prefill.engine.max_model_len=256 is below the decode pool's 512"):
        build_app(args | {"prefill": {"engine": {"max_model_len": 256}}})


def test_a_second_up_joins_the_state_of_the_same_ray_session_only(tmp_path):
    """Guards `duet down` after `duet up` twice: the second recorded the first one's Ray as not
    its own, and down left it running; a state file of an earlier session (that Ray gone, another
    cluster running) must not make down stop a cluster duet never started."""
    from duet.cluster.deploy import ClusterState, joined_state

    path = tmp_path / "local.yaml"
    path.write_text("http_options: {host: 127.0.0.1, port: 8000}\napplications:\n  - {name: b, import_path: duet.cluster.app:build_app}\n")
    serve_file = ServeFile.read(path)
    first = ClusterState(urls=["http://127.0.0.1:8000"], apps=["a"], started_ray=True, loopback=True, session="s1")
    state, joined = joined_state(first, serve_file, started_ray=False, session="s1")
    assert joined and state.started_ray and state.apps == ["a"] and first.apps == ["a"]
    other, joined = joined_state(first, serve_file, started_ray=False, session="s2")
    assert not joined and not other.started_ray and other.apps == []
    elsewhere = ClusterState(urls=["http://127.0.0.1:9000"], apps=["a"], started_ray=True, loopback=True, session="s1")
    with pytest.raises(DeployError, match="serves on 127.0.0.1:9000"):
        joined_state(elsewhere, serve_file, started_ray=False, session="s1")


def test_replicas_share_the_cores_only_when_asked_and_only_cpu_replicas_of_one_worker():
    from duet.cluster.app import SHARED_CORES_ENV, _core_sharing, _with_env

    shared = parse_args({"cores": {"share": True, "decode_tpot_share": 0.4}, "slo": {"tpot_ms": 250}})
    engine = shared.decode.merged_engine(shared.engine)
    assert _core_sharing(shared, engine) == {"tpot_budget_s": pytest.approx(0.1)}
    assert _core_sharing(parse_args({}), parse_args({}).decode.merged_engine(parse_args({}).engine)) is None  # off by default
    tensor_parallel = engine.model_copy(update={"tensor_parallel_size": 2})
    assert _core_sharing(shared, tensor_parallel) is None
    # Their OpenMP threads sleep soon after a step; a pool's own setting wins.
    assert _with_env({"num_cpus": 1}, SHARED_CORES_ENV)["runtime_env"] == {"env_vars": SHARED_CORES_ENV}
    own = {"num_cpus": 1, "runtime_env": {"env_vars": {"GOMP_SPINCOUNT": "0"}, "working_dir": "."}}
    assert _with_env(own, SHARED_CORES_ENV)["runtime_env"] == {"env_vars": {"GOMP_SPINCOUNT": "0"}, "working_dir": "."}
    with pytest.raises(AppConfigError, match="decode_tpot_share"):
        parse_args({"cores": {"decode_tpot_share": 0}})
