"""The parts ``duet simulate`` models a cluster with: a pool's step times (``duet profile``'s
fits), a replica stepping its engine's real ``Scheduler``, ``KVCacheManager`` and ``LoadTracker``
in simulated time, the cores the serving path takes from the engines, and a config's
application read into pools and router settings."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from duet.cluster import capacity

TOKEN = 1000  # what every simulated step samples; requests end at their length (EOS ignored)
EMPTY_STEP_S = 0.001  # an engine step that computes nothing (it only takes in KV that arrived)
MIN_ENGINE_SHARE = 0.25  # of the cores, what the engines keep however busy the serving path is


def cpu_stretch(busy_threads: int, serving_cores: float, cores: int) -> float:
    """How much longer the engines' steps take while ``busy_threads`` engine threads compute and
    the serving path (``duet profile --serving``) uses ``serving_cores`` of the machine's
    ``cores``: the serving path runs first (short bursts, which the scheduler lets run before
    long-running threads), and the engines share what is left, at least ``MIN_ENGINE_SHARE``
    of the cores. No stretch while the engines' threads fit in what is left (or with no cores
    given: a model without the machine)."""
    if cores <= 0 or busy_threads <= 0:
        return 1.0
    left = max(cores - serving_cores, MIN_ENGINE_SHARE * cores)
    return max(1.0, busy_threads / left)


def decode_seconds(fit: dict[str, float], rows: int, row_context: int) -> float:
    """A decode step of ``rows`` sequences of ``row_context`` tokens in all, by ``duet profile``'s
    fit ``a + b B + c B C``."""
    return fit["base_s"] + fit["per_row_s"] * rows + fit["per_row_context_s"] * row_context


@dataclass
class PoolModel:
    """A pool's step times (``duet profile``'s fits) and engine settings."""

    prompt: dict[str, float]
    decode: dict[str, float]
    settings: dict
    neighbours: dict | None = None  # its steps' slowdown beside busy engines (``duet profile``'s)
    threads: int = 1  # the cores a step of it computes on
    draft_tokens: float = 1.0  # with drafts: the tokens a sequence gets from a decode step (``duet profile``'s speculation)
    draft_verify: float = 1.0  # and what a row costs verifying its drafts, over a row without
    drafts_by_batch: tuple = ()  # both by the step's decoding sequences: ``(batch, tokens, verify)``, batch ascending

    @classmethod
    def from_profile(cls, pool: dict) -> PoolModel:
        neighbours, threads, speculation = pool.get("neighbours"), pool.get("num_threads", 1), pool.get("speculation")
        by_batch = capacity.drafts_by_batch(speculation)
        return cls(pool["prompt"]["fit"], pool["decode"]["fit"], pool["settings"], neighbours, threads, *capacity.drafts(speculation), by_batch)

    def drafts_at(self, batch: int) -> tuple[float, float]:
        """The tokens a sequence gets from a decode step of ``batch`` sequences, and what a row
        verifying drafts costs over a row without (``duet.cluster.capacity.drafts_at``)."""
        return capacity.drafts_at(self.drafts_by_batch, self.draft_tokens, self.draft_verify, batch)

    def step_seconds(self, prompt_tokens: int, prompt_work: float, rows: float, row_context: float, busy_neighbours: int = 0) -> float:
        """A step computing ``prompt_tokens`` of prompt chunks (``prompt_work``: each chunk's
        tokens times its mean context) and ``rows`` decoding sequences of ``row_context`` tokens
        in all (a row verifying drafts counts as the rows its verification costs: ``Replica.start``), while
        ``busy_neighbours`` other replicas on the machine step too: each part slowed by the
        profile's ratio beside busy engines, in proportion to how many of them are busy."""
        if not prompt_tokens and not rows:
            return EMPTY_STEP_S
        prompt_factor = decode_factor = 1.0
        if self.neighbours and self.neighbours["neighbours"]:
            share = min(busy_neighbours, self.neighbours["neighbours"]) / self.neighbours["neighbours"]
            prompt_factor = 1.0 + (self.neighbours["prompt_slowdown"] - 1.0) * share
            decode_factor = 1.0 + (self.neighbours["decode_slowdown"] - 1.0) * share
        prompt_linear = self.prompt["base_s"] + self.prompt["per_token_s"] * prompt_tokens + self.prompt["per_token_context_s"] * prompt_work
        prompt_s = max(self.prompt.get("floor_s", 0.0), prompt_linear)  # a roofline profile's: no step beats reading the weights
        decode_s = decode_seconds(self.decode, rows, row_context)
        if not prompt_tokens:
            return decode_s * decode_factor
        if not rows:
            return prompt_s * prompt_factor
        # One fixed cost for the step (the larger one), each part's work on top.
        base = max(self.prompt["base_s"] * prompt_factor, self.decode["base_s"] * decode_factor)
        return base + (prompt_linear - self.prompt["base_s"]) * prompt_factor + (decode_s - self.decode["base_s"]) * decode_factor


class Replica:
    """A replica: the engine's real scheduler and load tracker, stepping in simulated time."""

    def __init__(self, name: str, stage: str, model: PoolModel, clock: Callable[[], float]) -> None:
        from duet.kv_cache_manager import KVCacheManager
        from duet.load import LoadTracker
        from duet.scheduler import Scheduler

        settings = model.settings
        self.name, self.stage, self.model = name, stage, model  # stage: the role it serves now
        self.home = stage  # its pool's role
        self.role_since = clock()  # it keeps a role this long at least (``roles.hold_s``)
        self.prompts_sent = 0  # prompts it computed for replicas serving decode (their KV sent)
        manager = KVCacheManager(settings["num_blocks"], settings["block_size"], enable_caching=True)
        self.scheduler = Scheduler(manager, settings["max_num_seqs"], settings["max_num_batched_tokens"], settings["max_model_len"])
        self.load = LoadTracker(clock)
        self.clock = clock
        self.busy = False
        self.kv_results: list = []  # transfers that ended, reported with the next step
        self._credit: dict[str, float] = {}  # by sequence: the fraction of a token its drafts have earned
        self._step = None

    def start(self, busy_neighbours: int = 0, stretch: float = 1.0) -> float | None:
        """Schedule a step (``busy_neighbours``: other replicas stepping meanwhile; ``stretch``:
        ``cpu_stretch``'s); its duration, or None when there is nothing to do."""
        output = self.scheduler.schedule()
        if output.is_empty and not self.kv_results:
            return None
        prompt_tokens = 0
        prompt_work = rows = row_context = 0.0
        decoding = []
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            if request.num_computed_tokens + num_tokens < request.num_tokens or request.num_computed_tokens < request.num_prompt_tokens:
                prompt_tokens += num_tokens
                prompt_work += num_tokens * (request.num_computed_tokens + num_tokens / 2)
            else:
                decoding.append((request_id, request.num_computed_tokens))
        tokens, verify = self.model.drafts_at(len(decoding))
        for request_id, context in decoding:  # a row verifying drafts costs what the profile measured one costs
            weight = verify if request_id in output.scheduled_spec_token_ids else 1.0
            rows += weight
            row_context += weight * context
        seconds = self.model.step_seconds(prompt_tokens, prompt_work, rows, row_context, busy_neighbours) * stretch
        self._step = (output, seconds, tokens)
        self.busy = True
        return seconds

    def finish(self) -> list:
        """The step's outputs applied (and measured, as the engine measures its steps); the
        requests that got tokens or ended."""
        from duet.outputs import RunnerOutput

        (output, seconds, tokens), self._step, self.busy = self._step, None, False
        ids, sampled, proposals = [], [], {}
        wanted = math.ceil(tokens) - 1  # drafts for the next step: enough for as many tokens
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            ids.append(request_id)
            if request.num_computed_tokens + num_tokens < request.num_tokens:
                sampled.append([])  # a prompt's chunk before its last
                continue
            emitted = self._emitted(request_id, len(output.scheduled_spec_token_ids.get(request_id, ())), tokens)
            sampled.append([TOKEN] * emitted)
            drafts = min(wanted, request.sampling_params.max_tokens - request.num_output_tokens - emitted - 1)  # within its length
            if drafts > 0:
                proposals[request_id] = [TOKEN] * drafts
        results, self.kv_results = self.kv_results, []
        runner_output = RunnerOutput(ids, sampled, draft_token_ids=proposals, kv_results=results)
        if not output.is_empty:
            self.load.observe(output, runner_output, seconds)
        changed = self.scheduler.update_from_output(output, runner_output)
        for request in changed:
            if request.num_emitted_tokens == 0 and request.output_token_ids:  # its first token, computed here
                self.load.observe_first_token(self.clock() - request.arrival_time)
            request.num_emitted_tokens = request.num_output_tokens
            if request.is_finished:
                self._credit.pop(request.request_id, None)
        return changed

    def _emitted(self, request_id: str, drafts: int, tokens: float) -> int:
        """The tokens a sequence gets from a step that verified ``drafts`` of its drafts: one
        without drafts; with them, ``tokens`` (the profile's at the step's batch) on average,
        the fraction carried to its next step, at most all of them and one more."""
        if not drafts:
            return 1
        total = self._credit.get(request_id, 0.0) + tokens
        self._credit[request_id] = total - int(total)
        return min(int(total), drafts + 1)

    def engine_stats(self):
        """Its engine's ``EngineStats``."""
        from duet.messages import CoreStats, EngineStats, LoRAStats

        scheduler = self.scheduler
        return EngineStats(
            scheduler=scheduler.stats(), kv=scheduler.kv_cache_manager.stats("auto", "float32", 0),
            transfer=scheduler.kv_connector.stats(), load=self.load.stats(), spec=scheduler.spec_stats.stats(),
            cores=CoreStats(1, False, 0.0), lora=LoRAStats([], 0, 0, 0), worker_failure=None,
        )

    def report(self):
        """Its ``ReplicaStats``, as the replica reports them to the router."""
        from duet.messages import ReplicaStats

        return ReplicaStats.compose(self.stage, self.name, "", self.engine_stats(), 0, [])

    def busyness(self) -> tuple[int, int]:
        """What the decode pool's request router weighs: sequences here, then fewer free blocks."""
        stats = self.scheduler.stats()
        return stats.num_running + stats.num_waiting, -self.scheduler.kv_cache_manager.block_pool.num_free_blocks


@dataclass
class ClusterModel:
    """A config's application: its pools (at their starting sizes) and its router's settings."""

    colocated: bool
    prefill: list[PoolModel]
    decode: list[PoolModel]
    local_prefill_threshold: int
    adaptive_local_prefill: bool
    max_running: int
    ttft_s: float
    tpot_s: float
    transfer: dict[str, float] | None
    cores: int = 0  # the machine's (0: the engines never wait for a core)
    serving: dict[str, float] | None = None  # the serving path's CPU (``duet profile --serving``'s fit for the mode)
    scaling: dict = field(default_factory=dict)  # the autoscaled pools' ``sim_scale.PoolScaling``, by the policy's stage
    roles: object = None  # PD's ``duet.router.roles.RoleSettings`` (None: each replica serves its pool's role)


def cluster_model(config_path: str, profile: dict, app_name: str | None = None) -> ClusterModel:
    import yaml

    from duet.benchmarks.sim_scale import PoolScaling
    from duet.cluster.config import parse_args
    from duet.router.roles import RoleSettings

    apps = yaml.safe_load(Path(config_path).read_text())["applications"]
    app = next(app for app in apps if app_name is None or app.get("name", "default") == app_name)
    config = parse_args(app.get("args") or {})
    colocated = config.mode == "colocated"
    pools = {"decode": config.decode} if colocated else {"prefill": config.prefill, "decode": config.decode}
    scaling = {
        stage: spec for name, settings in pools.items()
        if (spec := PoolScaling.of(settings, stage := "colocated" if colocated else name, config.slo)) is not None
    }

    def pool(stage: str, settings) -> list[PoolModel]:
        if stage not in profile["pools"]:
            raise SystemExit(f"the profile has no {stage} pool: `duet profile {config_path}` (several configs go in one profile)")
        return [PoolModel.from_profile(profile["pools"][stage])] * settings.starting_replicas(stage)

    return ClusterModel(
        colocated=colocated,
        prefill=[] if colocated else pool("prefill", config.prefill),
        decode=pool("colocated" if colocated else "decode", config.decode),
        local_prefill_threshold=config.decode.local_prefill_threshold,
        adaptive_local_prefill=config.decode.adaptive_local_prefill,
        max_running=config.router.max_running_sequences,
        ttft_s=config.slo.ttft_ms / 1e3,
        tpot_s=config.slo.tpot_ms / 1e3,
        transfer=(profile.get("transfer") or {}).get("fit"),
        cores=profile["machine"]["cores"],
        serving=((profile.get("serving") or {}).get("colocated" if colocated else "pd") or {}).get("fit"),
        scaling=scaling,
        roles=None if colocated else RoleSettings(**config.roles.model_dump()),
    )
