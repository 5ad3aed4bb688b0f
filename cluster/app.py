"""YAML ``args`` -> a Serve application: the router ingress over a prefill and a decode pool
(``pd``), or over one pool that does both (``colocated``). A pool with an
``autoscaling_config`` is sized by ``duet.cluster.autoscale.PoolPolicy``; one without has a
fixed ``num_replicas``.

``build_app`` is the ``import_path`` of the shipped configs, so ``serve deploy`` runs them too.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from ray import serve
from ray.serve.config import RequestRouterConfig

from duet.cluster.config import AppConfigError, PoolSettings, parse_args
from duet.config import ConfigError, EngineArgs
from duet.messages import ROUTING_STATS_PERIOD_S

# A replica that shares its machine's cores: its OpenMP threads spin this many iterations at a
# barrier before they sleep, so that they do not spin into the other engine's step (GOMP's
# default spins for milliseconds; the runs that chose 100: docs/benchmarks.md, 2026-12-03).
SHARED_CORES_ENV = {"GOMP_SPINCOUNT": "100"}
POLICY = "duet.cluster.autoscale:PoolPolicy"


def build_app(args: dict) -> serve.Application:
    from duet.models.loader import max_positions, resolve_model_path
    from duet.cluster.admin import DuetIngress

    config = parse_args(args)
    # Resolve (for an alias: download and convert) and compile the CPU kernels once, here,
    # not in every replica at the same time.
    model_dir = str(resolve_model_path(config.model))
    if config.engine.device == "cpu":
        from duet.kernels import cpu_ops

        cpu_ops.load()
    colocated = config.mode == "colocated"
    _check_layouts({"decode": config.decode} | ({} if colocated else {"prefill": config.prefill}), config, Path(model_dir))
    kv_transfer = None if colocated else {"host": config.kv_transfer.host, "timeout_s": config.kv_transfer.timeout_s}
    decode_engine = config.decode.merged_engine(config.engine)
    decode_args = decode_engine.engine_args(model_dir)
    # The engine's own rule: the configured length, which may not exceed the model's.
    max_model_len = EngineArgs(**decode_args).scheduler_config(max_positions(Path(model_dir))).max_model_len
    if not colocated:
        prefill_args = config.prefill.merged_engine(config.engine).engine_args(model_dir)
        prefill_len = EngineArgs(**prefill_args).scheduler_config(max_positions(Path(model_dir))).max_model_len
        if prefill_len < max_model_len:
            raise AppConfigError(
                f"prefill.engine.max_model_len={prefill_len} is below the decode pool's {max_model_len}: the router accepts "
                "prompts up to the decode pool's length, which the prefill pool would refuse; set max_model_len in the "
                "application's engine section"
            )
    decode_role = "colocated" if colocated else "decode"
    pools = {decode_role: config.decode} | ({} if colocated else {"prefill": config.prefill})
    targets = {stage: pool.policy_targets(stage, config.slo) for stage, pool in pools.items()}
    decode_sharing = _core_sharing(config, decode_engine)
    decode = _deployment(decode_role, config.decode, decode_engine, "KVCapacityRouter", targets, decode_sharing is not None).bind(
        role=decode_role, engine_args=decode_args, num_threads=config.decode.num_threads(decode_engine), kv_transfer=kv_transfer,
        core_sharing=decode_sharing,
    )
    prefill = None
    if not colocated:
        prefill_engine = config.prefill.merged_engine(config.engine)
        prefill_sharing = _core_sharing(config, prefill_engine)
        prefill = _deployment("prefill", config.prefill, prefill_engine, "PrefixAffinityRouter", targets, prefill_sharing is not None).bind(
            role="prefill", engine_args=prefill_engine.engine_args(model_dir),
            num_threads=config.prefill.num_threads(prefill_engine), kv_transfer=kv_transfer, core_sharing=prefill_sharing,
        )
    router = config.router
    ingress = serve.deployment(name="router")(DuetIngress).options(
        num_replicas=router.num_replicas,
        ray_actor_options=router.ray_actor_options,
        max_ongoing_requests=router.max_running_sequences + router.max_queued_requests + 64,
    )
    return ingress.bind(
        prefill,
        decode,
        model_id=config.model_id,
        lora_modules=dict(decode_engine.lora_modules or {}),
        lora_registry=uuid.uuid4().hex,  # this deployment's adapters on the board, whatever a former one loaded
        model_dir=model_dir,
        max_model_len=max_model_len,
        block_size=decode_engine.block_size,
        local_prefill_threshold=0 if colocated else config.decode.local_prefill_threshold,
        adaptive_local_prefill=config.decode.adaptive_local_prefill,
        ttft_s=config.slo.ttft_ms / 1000,
        tpot_s=config.slo.tpot_ms / 1000,
        on_transfer_failure=config.decode.on_transfer_failure,
        max_migrations=router.max_migrations,
        max_running_sequences=router.max_running_sequences,
        max_queued_requests=router.max_queued_requests,
        max_queue_wait_s=router.max_queue_wait_s,
        max_prompts_per_request=router.max_prompts_per_request,
        max_body_bytes=router.max_body_bytes,
        api_keys=router.client_keys(),
        roles=None if colocated else config.roles.model_dump(),
        tool_call_parser=router.tool_call_parser,
        reasoning_parser=router.reasoning_parser,
        autoscaled={
            stage: (scaling["min_replicas"], scaling["max_replicas"])
            for stage, pool in pools.items() if (scaling := pool.serve_autoscaling(stage)) is not None
        },
        admin_api_key=router.admin_api_key or os.environ.get("DUET_ADMIN_API_KEY"),
    )


def _core_sharing(config, engine) -> dict | None:
    """A pool's replicas' part in sharing their machine's cores (``duet.cores``): CPU replicas of
    one worker, when ``cores.share`` is on (None: each computes on its own threads)."""
    one_worker = engine.tensor_parallel_size * engine.pipeline_parallel_size == 1
    if not config.cores.share or engine.device != "cpu" or not one_worker:
        return None
    return {"tpot_budget_s": config.cores.decode_tpot_share * config.slo.tpot_ms / 1000}


def _check_layouts(pools: dict[str, PoolSettings], config, model_dir: Path) -> None:
    """Before any actor starts: each pool's parallel layout splits the model (heads, experts,
    layers), and the application's bundles (CPUs and GPUs) fit in the Ray cluster this runs in.
    ``pools`` are keyed by their YAML section (a colocated pool is the decode section)."""
    import ray

    from duet.models.loader import read_arch
    from duet.models.pipeline_parallel import stage_layers
    from duet.models.tensor_parallel import check_layout

    arch = read_arch(model_dir)
    router = config.router.ray_actor_options
    needed = {kind: float(router.get(key, 0)) * config.router.num_replicas for kind, key in (("CPU", "num_cpus"), ("GPU", "num_gpus"))}
    for stage, pool in pools.items():
        engine = pool.merged_engine(config.engine)
        try:
            check_layout(arch, engine.tensor_parallel_size, engine.enable_expert_parallel)
            stage_layers(arch.num_layers, engine.pipeline_parallel_size, 0)
        except ConfigError as error:
            raise AppConfigError(f"{stage}.engine: {error}") from None
        for kind, amount in pool.resources(stage, engine).items():
            needed[kind] += amount
    if ray.is_initialized():
        for kind, amount in needed.items():
            available = ray.cluster_resources().get(kind, 0.0)
            if amount > available + 1e-9:
                raise AppConfigError(
                    f"the application's replicas and workers need {amount:g} {kind}s and the Ray cluster has {available:g}: "
                    f"{amount - available:g} missing (lower ray_actor_options, worker_num_cpus or replica counts, or add nodes)"
                )


def _deployment(name: str, pool: PoolSettings, engine, router_class: str, targets: dict, shares_cores: bool = False):
    """A pool: fixed, or scaled by its ``PoolPolicy`` (which sees every pool's ``targets``);
    a replica with several ranks and its workers share a placement group. A replica that
    ``shares_cores`` starts with ``SHARED_CORES_ENV`` (the pool's own ``env_vars`` win)."""
    from duet.cluster.replica import GRACEFUL_SHUTDOWN_TIMEOUT_S, HEALTH_CHECK_PERIOD_S, ServeReplica

    autoscaling = pool.serve_autoscaling(name)
    if autoscaling is not None:
        autoscaling["policy"] = {"policy_function": POLICY, "policy_kwargs": {"stage": name, "targets": targets}}
    return serve.deployment(name=name)(ServeReplica).options(
        num_replicas=pool.num_replicas if autoscaling is None else None,
        autoscaling_config=autoscaling,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_TIMEOUT_S,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        ray_actor_options=_with_env(pool.ray_actor_options, SHARED_CORES_ENV) if shares_cores else pool.ray_actor_options,
        placement_group_bundles=pool.placement_group_bundles(engine),
        placement_group_strategy=pool.placement_group_strategy if pool.placement_group_bundles(engine) else None,
        placement_group_bundle_label_selector=pool.bundle_label_selector(engine),
        max_ongoing_requests=pool.max_ongoing_requests,
        request_router_config=RequestRouterConfig(
            request_router_class=f"duet.router.routing.{router_class}",
            request_router_kwargs={"pool": name},
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
    )


def _with_env(actor_options: dict, env: dict[str, str]) -> dict:
    runtime_env = dict(actor_options.get("runtime_env") or {})
    runtime_env["env_vars"] = env | dict(runtime_env.get("env_vars") or {})
    return dict(actor_options) | {"runtime_env": runtime_env}
