"""The ``args`` of a duet application in a Serve config file, validated with readable errors."""

from __future__ import annotations

import dataclasses
import os
import typing
from pathlib import Path
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, model_validator

from duet.config import ConfigError, EngineArgs
from duet.dtypes import resolve_dtype, resolve_kv_cache_dtype


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _engine_fields() -> dict:
    """``EngineArgs``' own fields, types and defaults (one set of defaults: the engine's), but
    the model (the application's) and the KV connector (the builder sets it per pool)."""
    hints = typing.get_type_hints(EngineArgs)
    return {
        field.name: (hints[field.name], field.default)
        for field in dataclasses.fields(EngineArgs)
        if field.name not in ("model", "kv_transfer_config")
    }


class _EngineSettingsBase(_Strict):
    """``EngineArgs`` for the replicas of a pool (see ``duet.config``), plus torch threads."""

    num_threads: int | None = Field(default=None, ge=1, description="torch threads per replica; default: its num_cpus, at least 1")

    def engine_args(self, model_path: str) -> dict:
        args = self.model_dump(exclude={"num_threads"}) | {"model": model_path}
        EngineArgs(**args)  # fail at deploy time, with the engine's message, not in a replica
        return args


EngineSettings = pydantic.create_model("EngineSettings", __base__=_EngineSettingsBase, **_engine_fields())


def _policy_stage(stage: str) -> str:
    return "prefill" if stage == "prefill" else "decode"


class SLOSettings(_Strict):
    """The service level the router balances the stages for and the autoscaler sizes the pools for."""

    ttft_ms: float = Field(default=2000.0, gt=0, description="time to first token")
    tpot_ms: float = Field(default=200.0, gt=0, description="time per output token")


# duet's policy settings a pool's autoscaling_config may hold beside Serve's own keys.
_POLICY_KEYS = {"prefill": ("prompt_tokens_per_replica", "cooldown_s", "profile"), "decode": ("kv_usage", "cooldown_s", "profile")}
# Serve's keys duet sets when a pool's autoscaling_config leaves them out: react within seconds.
AUTOSCALING_DEFAULTS = {
    "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 5.0, "downscale_delay_s": 30.0,
    "metrics_interval_s": 1.0, "look_back_period_s": 5.0,
}


class PoolSettings(_Strict):
    num_replicas: int = Field(default=1, ge=1, description="a fixed pool size; autoscaling_config makes it move")
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 1})
    max_ongoing_requests: int = Field(default=256, ge=1, description="calls in flight per replica (the engine batches them)")
    engine: dict[str, Any] = Field(default_factory=dict, description="overrides of the application's engine settings")
    worker_num_cpus: float = Field(
        default=1.0, gt=0,
        description="with several ranks (engine.tensor_parallel_size x pipeline_parallel_size): the CPUs of each rank's worker, a bundle of its own in the "
        "replica's placement group (the replica's actor keeps ray_actor_options, in the first bundle)",
    )
    placement_group_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        default="PACK", description="how a replica's bundles spread over nodes (Ray's placement group strategies)"
    )
    autoscaling_config: dict[str, Any] | None = Field(
        default=None,
        description="Serve's autoscaling_config keys (min_replicas, max_replicas, initial_replicas, upscale_delay_s, "
        "downscale_delay_s, metrics_interval_s, look_back_period_s, ...) plus duet's policy settings (see duet.cluster.autoscale)",
    )

    def serve_autoscaling(self, stage: str) -> dict | None:
        """Serve's part of ``autoscaling_config``, with duet's defaults; None for a fixed pool."""
        if self.autoscaling_config is None:
            return None
        return AUTOSCALING_DEFAULTS | {
            key: value for key, value in self.autoscaling_config.items() if key not in _POLICY_KEYS[_policy_stage(stage)]
        }

    def policy_targets(self, stage: str, slo: SLOSettings) -> dict:
        """duet's part: the ``Targets`` of this pool's policy."""
        own = {key: value for key, value in (self.autoscaling_config or {}).items() if key in _POLICY_KEYS[_policy_stage(stage)]}
        return {"ttft_s": slo.ttft_ms / 1000, "tpot_s": slo.tpot_ms / 1000} | own

    @model_validator(mode="after")
    def _autoscaling_valid(self) -> PoolSettings:
        if self.autoscaling_config is None:
            return self
        if "num_replicas" in self.model_fields_set:
            raise ValueError("num_replicas and autoscaling_config exclude each other: set autoscaling_config.initial_replicas instead")
        if "policy" in self.autoscaling_config:
            raise ValueError("autoscaling_config.policy: duet sets the policy of its pools (duet.cluster.autoscale)")
        from ray.serve.config import AutoscalingConfig

        from duet.cluster.autoscale import Targets

        stage = "decode" if isinstance(self, DecodePoolSettings) else "prefill"
        unknown = sorted(set(self.autoscaling_config) - set(AutoscalingConfig.model_fields) - set(_POLICY_KEYS[stage]))
        if unknown:
            raise ValueError(
                f"autoscaling_config: unknown setting {', '.join(unknown)} (Serve's keys, and duet's for this pool: "
                f"{', '.join(_POLICY_KEYS[stage])})"
            )
        try:
            AutoscalingConfig(**self.serve_autoscaling(stage))
            Targets(**self.policy_targets(stage, SLOSettings()))
        except pydantic.ValidationError as error:
            raise ValueError("autoscaling_config: " + readable(error).replace("\n", "; ")) from None
        except (TypeError, ValueError) as error:
            raise ValueError(f"autoscaling_config: {error}") from None
        return self

    def merged_engine(self, base: EngineSettings) -> EngineSettings:
        return EngineSettings(**(base.model_dump(exclude_unset=True) | self.engine))

    def num_threads(self, engine: EngineSettings) -> int:
        return engine.num_threads or max(1, round(float(self.ray_actor_options.get("num_cpus", 1))))

    def placement_group_bundles(self, engine: EngineSettings) -> list[dict[str, float]] | None:
        """The replica's bundle, then one per worker rank; None for a replica computing in its own process."""
        num_workers = engine.tensor_parallel_size * engine.pipeline_parallel_size
        if num_workers == 1:
            return None
        options = self.ray_actor_options
        # A bundle may not be empty: a replica asking for no CPU still gets a sliver of one. Its custom
        # resources go in its bundle too (Serve places the replica's actor there).
        replica = (
            {"CPU": max(float(options.get("num_cpus", 1)), 0.01)}
            | ({"GPU": options["num_gpus"]} if options.get("num_gpus") else {})
            | {name: float(amount) for name, amount in (options.get("resources") or {}).items()}
        )
        worker = {"CPU": self.worker_num_cpus} | ({"GPU": 1.0} if engine.device.startswith("cuda") else {})
        return [replica] + [worker] * num_workers

    def bundle_label_selector(self, engine: EngineSettings) -> list[dict[str, str]] | None:
        """A replica with several ranks: its ``label_selector`` holds for every bundle, so that its
        workers run on the nodes the replica may run on."""
        selector = self.ray_actor_options.get("label_selector")
        if not selector or self.placement_group_bundles(engine) is None:
            return None
        return [dict(selector) for _ in self.placement_group_bundles(engine)]

    def starting_replicas(self, stage: str) -> int:
        """The pool's size when deployed: its fixed size, or its autoscaler's first."""
        scaling = self.serve_autoscaling(stage)
        return self.num_replicas if scaling is None else max(scaling.get("initial_replicas") or 0, scaling["min_replicas"])

    def resources(self, stage: str, engine: EngineSettings) -> dict[str, float]:
        """Logical CPUs and GPUs the pool's replicas (and their workers) take at their starting count."""
        options = self.ray_actor_options
        bundles = self.placement_group_bundles(engine) or [
            {"CPU": float(options.get("num_cpus", 1)), "GPU": float(options.get("num_gpus", 0))}
        ]
        replicas = self.starting_replicas(stage)
        return {kind: replicas * sum(bundle.get(kind, 0.0) for bundle in bundles) for kind in ("CPU", "GPU")}


class DecodePoolSettings(PoolSettings):
    local_prefill_threshold: int = Field(
        default=0, ge=0, description="prompts shorter than this skip the prefill pool (the starting point of adaptive_local_prefill)"
    )
    adaptive_local_prefill: bool = Field(
        default=True, description="per sequence, compute its prompt where its first token comes sooner (duet.router.balance)"
    )
    on_transfer_failure: Literal["recompute", "fail"] = "recompute"


class RouterSettings(_Strict):
    num_replicas: int = Field(default=1, ge=1)
    ray_actor_options: dict[str, Any] = Field(default_factory=lambda: {"num_cpus": 0.25})
    max_running_sequences: int = Field(
        default=64, ge=1, description="sequences (prompts x n) in the pools at once; a request with more runs alone"
    )
    max_queued_requests: int = Field(default=256, ge=0, description="requests waiting for admission; more get 429")
    max_queue_wait_s: float | None = Field(
        default=60.0, gt=0, description="longest a request may wait for admission; one predicted to wait longer gets 503 at once (null: no limit)"
    )
    max_prompts_per_request: int = Field(default=64, ge=1, description="prompts in one completions request; more get 400")
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    api_key: str | list[str] | None = Field(
        default=None, description="the client keys: a request must bear one as 'Authorization: Bearer <key>' (DUET_API_KEY adds one)"
    )
    api_keys_file: str | None = Field(default=None, description="a file of more client keys, one a line ('#' starts a comment)")
    admin_api_key: str | None = Field(
        default=None, description="the key of the /duet/ endpoints (status, scale, integrity); DUET_ADMIN_API_KEY also sets it"
    )
    max_migrations: int = Field(
        default=3, ge=0, description="moves between decode replicas a sequence may make; one more fails it with an error event"
    )
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        default="auto",
        description="how the model writes tool calls: auto (from its chat template; Hermes' where it renders no tools), hermes, llama3_json, mistral",
    )
    reasoning_parser: Literal["auto", "think", "none"] = Field(
        default="auto",
        description="part <think>...</think> from content as reasoning_content: auto (where the chat template writes </think>), think (always), none",
    )

    @model_validator(mode="after")
    def _keys_valid(self) -> RouterSettings:
        keys = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or [])
        if any(not key.strip() for key in keys) or (self.admin_api_key is not None and not self.admin_api_key.strip()):
            raise ValueError("api_key and admin_api_key: a key may not be empty (leave the setting out for an open server)")
        return self

    def client_keys(self) -> list[str]:
        """Every client key: ``api_key`` (one or a list), the lines of ``api_keys_file``, and
        ``DUET_API_KEY``; none means the client API is open."""
        keys = [self.api_key] if isinstance(self.api_key, str) else list(self.api_key or [])
        if self.api_keys_file is not None:
            try:
                lines = Path(self.api_keys_file).expanduser().read_text().splitlines()
            except OSError as error:
                raise AppConfigError(f"router.api_keys_file: cannot read {self.api_keys_file} ({error.strerror})") from None
            keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if os.environ.get("DUET_API_KEY"):
            keys.append(os.environ["DUET_API_KEY"])
        return [key.strip() for key in keys]


class CoreSettings(_Strict):
    """How the replicas on one machine use its cores (``duet.cores``)."""

    share: bool = Field(
        default=False,
        description="CPU replicas of one worker share their machine's cores step by step (prompts take every core while "
        "decoding streams have time to spare), rather than each computing on its own num_cpus",
    )
    decode_tpot_share: float = Field(
        default=0.5, gt=0, le=1,
        description="of the TPOT target, the time a token that decoding streams keep to while prompts take the cores",
    )


class RoleSettings(_Strict):
    """Replicas serving the other pool's role while theirs has work to spare (``duet.router.roles``)."""

    move: bool = Field(
        default=True,
        description="a PD replica serves the other role while its own is spare and the other short, and a prefill replica "
        "takes the decode role at once when no decode replica is left",
    )
    lend_idle: bool = Field(
        default=False,
        description="an idle prefill replica also serves decode while decode runs past half its TPOT target, and busy decode "
        "replicas shed sequences to it (on two cores: more goodput past capacity, less below it)",
    )
    min_prefill: int = Field(default=0, ge=0, description="replicas kept serving prefill (decode replicas compute prompts themselves)")
    min_decode: int = Field(default=1, ge=1, description="replicas kept serving decode")
    hold_s: float = Field(default=5.0, ge=0, description="the least time a replica keeps a role it took")


class KVTransferSettings(_Strict):
    host: str = Field(default="127.0.0.1", description="address decode replicas listen on; 'auto' = the Ray node's IP")
    timeout_s: float = Field(default=30.0, gt=0)


class AppArgs(_Strict):
    """One duet application: a model served by a prefill and a decode pool (``pd``) or by one
    pool doing both (``colocated``)."""

    model_id: str = Field(default="smollm2", min_length=1, description="the model's name in the API")
    model: str = Field(default="smollm2", min_length=1, description="an alias such as smollm2, or a Hugging Face model directory")
    mode: Literal["pd", "colocated"] = "pd"
    engine: EngineSettings = Field(default_factory=EngineSettings)
    prefill: PoolSettings | None = None
    decode: DecodePoolSettings = Field(default_factory=DecodePoolSettings)
    router: RouterSettings = Field(default_factory=RouterSettings)
    slo: SLOSettings = Field(default_factory=SLOSettings)
    kv_transfer: KVTransferSettings = Field(default_factory=KVTransferSettings)
    cores: CoreSettings = Field(default_factory=CoreSettings)
    roles: RoleSettings = Field(default_factory=RoleSettings)

    @model_validator(mode="after")
    def _pools_match_mode(self) -> AppArgs:
        if self.mode == "colocated" and self.prefill is not None:
            raise ValueError("mode 'colocated' has no prefill pool: remove the 'prefill' section or set mode: pd")
        if self.mode == "pd" and self.prefill is None:
            self.prefill = PoolSettings()
        if self.prefill is not None and self.prefill.engine.get("speculative_config") is not None:
            raise ValueError("prefill.engine.speculative_config: speculation runs where tokens are decoded; set it under decode.engine")
        for name, pool in (("prefill", self.prefill), ("decode", self.decode)):
            if pool is None:
                continue
            try:
                pool.merged_engine(self.engine).engine_args(self.model)
            except (ValueError, ConfigError) as error:
                raise ValueError(f"{name}.engine: {error}") from None
        if self.prefill is not None:
            check_pools_exchange_kv(self.prefill.merged_engine(self.engine), self.decode.merged_engine(self.engine))
        self._profiles_read()
        return self

    def _profiles_read(self) -> None:
        """A pool sized ahead (``autoscaling_config.profile``) names a profile that reads and has
        the pool; its path is made absolute (Serve's controller reads it, from its own folder)."""
        from duet.cluster.capacity import load_models

        for section, pool in (("prefill", self.prefill), ("decode", self.decode)):
            path = ((pool.autoscaling_config or {}) if pool is not None else {}).get("profile")
            if path is None:
                continue
            stage = "colocated" if self.mode == "colocated" else section
            setting = f"{section}.autoscaling_config.profile"
            if not isinstance(path, str) or not path:
                raise ValueError(f"{setting}: a path to a `duet profile` JSON, got {path!r}")
            try:
                models = load_models(path)
            except ValueError as error:
                raise ValueError(f"{setting}: {error}") from None
            if stage not in models:
                raise ValueError(f"{setting}: {path} has no {stage} pool (it has {', '.join(sorted(models)) or 'none'}): profile this config")
            pool.autoscaling_config["profile"] = str(Path(path).resolve())


def readable(error: Exception) -> str:
    """A pydantic error as lines a user can act on: 'field.path: what is wrong'."""
    errors = getattr(error, "errors", None)
    if errors is None:
        return str(error)
    lines = []
    for item in errors():
        location = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown setting (check its spelling and its section)"
        lines.append(f"{location}: {message}" if location else message)
    return "\n".join(lines)


class AppConfigError(ValueError):
    """The application's ``args`` are invalid; the message lists each problem."""


def parse_args(args: dict) -> AppArgs:
    from pydantic import ValidationError

    try:
        return AppArgs.model_validate(args or {})
    except ValidationError as error:
        raise AppConfigError(readable(error)) from None


def check_pools_exchange_kv(prefill, decode) -> None:
    """The prefill pool's KV blocks must land in the decode pool's as they are: same model (one
    per application), block size, dtype, KV cache dtype and device kind. Fails with the setting to change."""
    pairs = {
        "block_size": (prefill.block_size, decode.block_size),
        "dtype": (resolve_dtype(prefill.dtype, prefill.device), resolve_dtype(decode.dtype, decode.device)),
        "kv_cache_dtype": tuple(resolve_kv_cache_dtype(pool.kv_cache_dtype, resolve_dtype(pool.dtype, pool.device)) for pool in (prefill, decode)),
        "device": (prefill.device.split(":")[0], decode.device.split(":")[0]),
        "lora_modules": (prefill.lora_modules or {}, decode.lora_modules or {}),  # a prompt's KV is computed with its adapter
    }
    for name, (theirs, ours) in pairs.items():
        if theirs != ours:
            shown = [str(value).removeprefix("torch.") for value in (theirs, ours)]
            raise ValueError(
                f"prefill.engine.{name}={shown[0]} but decode.engine.{name}={shown[1]}: the pools exchange KV blocks, "
                f"so {name} must be the same in both (set it in the application's engine section)"
            )
