"""``duet simulate``: ``duet bench serve``'s load run on a model of a config's cluster, in
simulated time, from a profile (``duet profile``) of its engines' steps.

    duet simulate --profile profile.json --config configs/local-pd.yaml [--config ...] --rate 1,2
                  [duet bench serve's load options] [--json out.json] [--measured real.json] [--plot out.png]

What runs is the code's own decision logic, with simulated time for a clock:

- each replica is a real ``Scheduler`` and ``KVCacheManager`` (continuous batching, chunked
  prefill under the token budget, the prefix cache, preemption, the blocks a transfer reserves
  and holds) and ``LoadTracker``; its steps take the time the profile's fits give for the tokens
  and contexts each step computes, instead of running a model;
- the router admits up to ``max_running_sequences``, and its waiting room asks the stage
  balancer (``duet.router.balance``, on the replicas' reports every ``ROUTING_STATS_PERIOD_S``)
  where each context is computed, or the threshold rule alone without ``adaptive_local_prefill``;
  a prompt through PD goes to the prefill replica with the fewest prompt tokens pending, its KV
  reserved on the decode replica with the fewest sequences and sent when its first token is out
  (the profile's transfer fit; free without one).

Its output is ``duet bench serve``'s table and JSON, from the same sessions and arrival times
(same seeds); ``--measured`` takes a ``duet bench serve --json`` of the same runs and prints each
figure's error (``--plot``: predicted against measured).

Replicas on one machine slow each other's steps (cores, caches, memory bandwidth): a step is
slowed by the profile's ratio beside busy engines (``duet profile``'s neighbours), in proportion
to how many of the other replicas are stepping when it starts.

Not modelled yet: the CPU the router, Serve's proxy and Ray take from the engines; speculative
decoding's accepted tokens (no drafts); autoscaling (each pool at its starting size); roles that
move; prefix-affinity routing (least pending prompt tokens instead).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from duet.benchmarks.serve import (
    RequestResult, add_load_arguments, chosen_workloads, format_table, make_sessions, run_label, run_seed, summarise,
)
from duet.benchmarks.workloads import TurnSpec
from duet.messages import ROUTING_STATS_PERIOD_S
from duet.router.waiting import ROOM_WAIT_S, WAIT_POLL_S

TOKEN = 1000  # what every simulated step samples; requests end at their length (EOS ignored)
EMPTY_STEP_S = 0.001  # an engine step that computes nothing (it only takes in KV that arrived)


@dataclass
class PoolModel:
    """A pool's step times (``duet profile``'s fits) and engine settings."""

    prompt: dict[str, float]
    decode: dict[str, float]
    settings: dict
    neighbours: dict | None = None  # its steps' slowdown beside busy engines (``duet profile``'s)

    @classmethod
    def from_profile(cls, pool: dict) -> PoolModel:
        return cls(pool["prompt"]["fit"], pool["decode"]["fit"], pool["settings"], pool.get("neighbours"))

    def step_seconds(self, prompt_tokens: int, prompt_work: float, rows: int, row_context: int, busy_neighbours: int = 0) -> float:
        """A step computing ``prompt_tokens`` of prompt chunks (``prompt_work``: each chunk's
        tokens times its mean context) and ``rows`` decoding sequences of ``row_context`` tokens
        in all, while ``busy_neighbours`` other replicas on the machine step too: each part slowed
        by the profile's ratio beside busy engines, in proportion to how many of them are busy."""
        if not prompt_tokens and not rows:
            return EMPTY_STEP_S
        prompt_factor = decode_factor = 1.0
        if self.neighbours and self.neighbours["neighbours"]:
            share = min(busy_neighbours, self.neighbours["neighbours"]) / self.neighbours["neighbours"]
            prompt_factor = 1.0 + (self.neighbours["prompt_slowdown"] - 1.0) * share
            decode_factor = 1.0 + (self.neighbours["decode_slowdown"] - 1.0) * share
        prompt_s = self.prompt["base_s"] + self.prompt["per_token_s"] * prompt_tokens + self.prompt["per_token_context_s"] * prompt_work
        decode_s = self.decode["base_s"] + self.decode["per_row_s"] * rows + self.decode["per_row_context_s"] * row_context
        if not prompt_tokens:
            return decode_s * decode_factor
        if not rows:
            return prompt_s * prompt_factor
        # One fixed cost for the step (the larger one), each part's work on top.
        base = max(self.prompt["base_s"] * prompt_factor, self.decode["base_s"] * decode_factor)
        return base + (prompt_s - self.prompt["base_s"]) * prompt_factor + (decode_s - self.decode["base_s"]) * decode_factor


@dataclass
class Sequence:
    """One request as its client sees it."""

    spec: TurnSpec
    session: int
    turn: int
    sent_s: float
    token_times: list[float] = field(default_factory=list)


class Replica:
    """A replica: the engine's real scheduler and load tracker, stepping in simulated time."""

    def __init__(self, name: str, stage: str, model: PoolModel, clock: Callable[[], float]) -> None:
        from duet.kv_cache_manager import KVCacheManager
        from duet.load import LoadTracker
        from duet.scheduler import Scheduler

        settings = model.settings
        self.name, self.stage, self.model = name, stage, model
        manager = KVCacheManager(settings["num_blocks"], settings["block_size"], enable_caching=True)
        self.scheduler = Scheduler(manager, settings["max_num_seqs"], settings["max_num_batched_tokens"], settings["max_model_len"])
        self.load = LoadTracker(clock)
        self.clock = clock
        self.busy = False
        self.kv_results: list = []  # transfers that ended, reported with the next step
        self._step = None

    def start(self, busy_neighbours: int = 0) -> float | None:
        """Schedule a step (``busy_neighbours``: other replicas stepping meanwhile); its duration,
        or None when there is nothing to do."""
        output = self.scheduler.schedule()
        if output.is_empty and not self.kv_results:
            return None
        prompt_tokens = rows = row_context = 0
        prompt_work = 0.0
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            if request.num_computed_tokens + num_tokens < request.num_tokens or request.num_computed_tokens < request.num_prompt_tokens:
                prompt_tokens += num_tokens
                prompt_work += num_tokens * (request.num_computed_tokens + num_tokens / 2)
            else:
                rows += 1
                row_context += request.num_computed_tokens
        seconds = self.model.step_seconds(prompt_tokens, prompt_work, rows, row_context, busy_neighbours)
        self._step = (output, seconds)
        self.busy = True
        return seconds

    def finish(self) -> list:
        """The step's outputs applied (and measured, as the engine measures its steps); the
        requests that got tokens or ended."""
        from duet.outputs import RunnerOutput

        (output, seconds), self._step, self.busy = self._step, None, False
        ids, sampled = [], []
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            ids.append(request_id)
            sampled.append([TOKEN] if request.num_computed_tokens + num_tokens >= request.num_tokens else [])
        results, self.kv_results = self.kv_results, []
        runner_output = RunnerOutput(ids, sampled, kv_results=results)
        if not output.is_empty:
            self.load.observe(output, runner_output, seconds)
        changed = self.scheduler.update_from_output(output, runner_output)
        for request in changed:
            if request.num_emitted_tokens == 0 and request.output_token_ids:  # its first token, computed here
                self.load.observe_first_token(self.clock() - request.arrival_time)
            request.num_emitted_tokens = request.num_output_tokens
        return changed

    def report(self):
        """Its ``ReplicaStats``, as the replica reports them to the router."""
        from duet.messages import CoreStats, EngineStats, LoRAStats, ReplicaStats

        scheduler = self.scheduler
        engine = EngineStats(
            scheduler=scheduler.stats(), kv=scheduler.kv_cache_manager.stats("auto", "float32", 0),
            transfer=scheduler.kv_connector.stats(), load=self.load.stats(), spec=scheduler.spec_stats.stats(),
            cores=CoreStats(1, False, 0.0), lora=LoRAStats([], 0, 0, 0), worker_failure=None,
        )
        return ReplicaStats.compose(self.stage, self.name, "", engine, 0, [])

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


def cluster_model(config_path: str, profile: dict, app_name: str | None = None) -> ClusterModel:
    import yaml

    from duet.cluster.config import parse_args

    apps = yaml.safe_load(Path(config_path).read_text())["applications"]
    app = next(app for app in apps if app_name is None or app.get("name", "default") == app_name)
    config = parse_args(app.get("args") or {})
    colocated = config.mode == "colocated"

    def pool(stage: str, settings) -> list[PoolModel]:
        if stage not in profile["pools"]:
            raise SystemExit(f"the profile has no {stage} pool: `duet profile {config_path}` (several configs go in one profile)")
        scaling = settings.serve_autoscaling(stage)
        size = settings.num_replicas if scaling is None else max(scaling.get("initial_replicas") or 0, scaling["min_replicas"])
        return [PoolModel.from_profile(profile["pools"][stage])] * size

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
    )


@dataclass(eq=False)
class _Context:
    """A context waiting in the router for the balancer's choice."""

    request_id: str
    num_tokens: int
    since: float


class Simulation:
    """Events in simulated time: arrivals, steps ending, transfers arriving, the replicas'
    reports, the waiting room's polls. The router's choices are its own code's: the stage
    balancer (``duet.router.balance``) on the replicas' reports, asked as its waiting room asks."""

    def __init__(self, cluster: ClusterModel, think_time_s: float = 0.0) -> None:
        from duet.router.balance import StageBalancer

        self.cluster, self.think_time_s = cluster, think_time_s
        self.now = 0.0
        clock = self.clock
        stage = "colocated" if cluster.colocated else "decode"
        self.prefill = [Replica(f"prefill-{i}", "prefill", model, clock) for i, model in enumerate(cluster.prefill)]
        self.decode = [Replica(f"{stage}-{i}", stage, model, clock) for i, model in enumerate(cluster.decode)]
        self._reports: dict[str, list] = {"prefill": [], "decode": []}
        pools = {"prefill": self.prefill, "decode": self.decode}
        stats = (lambda pool: self._reports[pool] or None) if cluster.adaptive_local_prefill else (lambda pool: None)
        self.balancer = StageBalancer(
            stats, lambda pool: len(pools[pool]), cluster.local_prefill_threshold, cluster.ttft_s, cluster.tpot_s, clock=clock
        )
        self._events: list = []
        self._order = itertools.count()
        self._transfer_ids = itertools.count(1)
        self._receivers: dict[int, Replica] = {}  # transfer id -> the decode replica its KV goes to
        self._choices: dict[str, object] = {}  # request id -> the balancer's choice, until its first token
        self.sequences: dict[str, Sequence] = {}
        self._admission: list[str] = []  # past max_running_sequences: waiting for a slot, in order
        self._contexts: list[_Context] = []  # admitted, waiting for the balancer's choice
        self._running = 0
        self._polling = False
        self._sessions: dict[int, list[TurnSpec]] = {}

    def clock(self) -> float:
        return self.now

    def at(self, when: float, action, *args) -> None:
        heapq.heappush(self._events, (when, next(self._order), action, args))

    def run(self, sessions: list[list[TurnSpec]], arrivals: list[float]) -> tuple[list[RequestResult], float]:
        for index, (turns, when) in enumerate(zip(sessions, arrivals)):
            self._sessions[index] = turns
            self.at(when, self._arrive, index, 0)
        if self.prefill:
            self.at(0.0, self._report)
        while self._events:
            self.now, _, action, args = heapq.heappop(self._events)
            action(*args)
        results = [self._result(sequence) for sequence in self.sequences.values()]
        end = max((sequence.token_times[-1] for sequence in self.sequences.values() if sequence.token_times), default=0.0)
        return sorted(results, key=lambda result: result.sent_s), end

    def _unfinished(self) -> bool:
        return any(len(sequence.token_times) < sequence.spec.output_len for sequence in self.sequences.values()) or len(
            self.sequences
        ) < sum(map(len, self._sessions.values()))

    def _report(self) -> None:
        """Every replica's stats, as they reach the router every ``ROUTING_STATS_PERIOD_S``."""
        self._reports = {"prefill": [replica.report() for replica in self.prefill], "decode": [replica.report() for replica in self.decode]}
        if self._unfinished():
            self.at(self.now + ROUTING_STATS_PERIOD_S, self._report)

    def _arrive(self, session: int, turn: int) -> None:
        request_id = f"s{session}-t{turn}"
        self.sequences[request_id] = Sequence(self._sessions[session][turn], session, turn, self.now)
        self._admission.append(request_id)
        self._admit()

    def _admit(self) -> None:
        """Admission (``max_running_sequences``), then the waiting room's choices."""
        while self._admission and self._running < self.cluster.max_running:
            request_id = self._admission.pop(0)
            self._running += 1
            if not self.prefill:
                self._place_local(request_id, None)
            else:
                self._contexts.append(_Context(request_id, len(self.sequences[request_id].spec.prompt), self.now))
        if not self._contexts:
            return
        choices = self.balancer.admit([(context.num_tokens, self.now - context.since) for context in self._contexts])
        for context, choice in list(zip(self._contexts, choices)):
            if choice is not None:
                self._contexts.remove(context)
                self._place_local(context.request_id, choice) if choice.local else self._place_remote(context.request_id, choice)
        for context in [context for context in self._contexts if self.now - context.since >= ROOM_WAIT_S]:
            self._contexts.remove(context)  # the client gets a 503
            self._ended(context.request_id)
        if self._contexts and not self._polling:
            self._polling = True
            self.at(self.now + WAIT_POLL_S, self._poll)

    def _poll(self) -> None:
        self._polling = False
        self._admit()

    def _params(self, request_id: str):
        from duet.sampling_params import SamplingParams

        length = self.sequences[request_id].spec.output_len
        return SamplingParams(temperature=0.0, max_tokens=length, min_tokens=length, ignore_eos=True)

    def _place_local(self, request_id: str, choice) -> None:
        from duet.request import Request

        decode = min(self.decode, key=Replica.busyness)
        prompt = self.sequences[request_id].spec.prompt
        decode.scheduler.add_request(Request(request_id, prompt, self._params(request_id), None, arrival_time=self.now))
        if choice is not None:
            self._choices[request_id] = choice
        self._kick(decode)

    def _place_remote(self, request_id: str, choice) -> None:
        from duet.messages import KVDestination
        from duet.request import Request
        from duet.sampling_params import SamplingParams

        prompt = self.sequences[request_id].spec.prompt
        decode = min(self.decode, key=Replica.busyness)
        transfer_id = next(self._transfer_ids)
        request = Request(request_id, prompt, self._params(request_id), None, arrival_time=self.now)
        if not decode.scheduler.add_remote_request(request, transfer_id):
            choice.done()  # no room for its KV: it waits again, first in line
            self._contexts.insert(0, _Context(request_id, len(prompt), self.sequences[request_id].sent_s))
            return
        self._receivers[transfer_id] = decode
        self._choices[request_id] = choice
        prefill = min(self.prefill, key=lambda replica: replica.scheduler.stats().prompt_tokens_pending)
        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        send = KVDestination(transfer_id, (), "decode")
        prefill.scheduler.add_request(Request(request_id, prompt, first, None, kv_send=send, arrival_time=self.now))
        self._kick(prefill)

    def _kick(self, replica: Replica) -> None:
        if not replica.busy:
            seconds = replica.start(sum(other.busy for other in (*self.prefill, *self.decode) if other is not replica))
            if seconds is not None:
                self.at(self.now + seconds, self._finished_step, replica)

    def _finished_step(self, replica: Replica) -> None:
        for request in replica.finish():
            sequence = self.sequences[request.request_id]
            if replica.stage == "prefill":
                if request.output_token_ids and not sequence.token_times:
                    sequence.token_times.append(self.now)  # the router streams the first token on
                    self._first_token(request.request_id)
                    tokens = len(request.prompt_token_ids)
                    self.at(self.now + self._transfer_s(tokens), self._arrived, replica, request.kv_send.transfer_id)
                continue
            new = len(request.output_token_ids) - len(sequence.token_times)
            if new > 0:
                sequence.token_times += [self.now] * new
                self._first_token(request.request_id)
            if request.is_finished:
                self._running -= 1
                self._ended(request.request_id)
        self._kick(replica)

    def _first_token(self, request_id: str) -> None:
        choice = self._choices.pop(request_id, None)
        if choice is not None:
            choice.done(first_token=True)
            if self._contexts:
                self._admit()

    def _transfer_s(self, tokens: int) -> float:
        fit = self.cluster.transfer
        return 0.0 if fit is None else fit["base_s"] + fit["per_token_s"] * tokens

    def _arrived(self, sender: Replica, transfer_id: int) -> None:
        from duet.outputs import KVTransferResult

        sender.kv_results.append(KVTransferResult(transfer_id, ok=True))
        self._kick(sender)
        receiver = self._receivers.pop(transfer_id)
        receiver.kv_results.append(KVTransferResult(transfer_id, ok=True, first_token_id=TOKEN))
        self._kick(receiver)

    def _ended(self, request_id: str) -> None:
        sequence = self.sequences[request_id]
        turns = self._sessions[sequence.session]
        if sequence.turn + 1 < len(turns):
            self.at(self.now + self.think_time_s, self._arrive, sequence.session, sequence.turn + 1)
        self._admit()

    def _result(self, sequence: Sequence) -> RequestResult:
        times = sequence.token_times
        if len(times) < sequence.spec.output_len:
            return RequestResult(ok=False, turn=sequence.turn, sent_s=sequence.sent_s, error="no room for it within the wait (503)")
        return RequestResult(
            ok=True, turn=sequence.turn, prompt_tokens=len(sequence.spec.prompt), sent_s=sequence.sent_s,
            ttft=times[0] - sequence.sent_s, tt2t=(times[1] if len(times) > 1 else times[0]) - sequence.sent_s,
            e2e=times[-1] - sequence.sent_s, itls=[b - a for a, b in zip(times, times[1:])], output_tokens=len(times),
        )


def arrival_times(num_sessions: int, rate: float, seed: int) -> list[float]:
    """When each session's first request is sent: ``duet bench serve``'s Poisson schedule (its seed)."""
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(num_sessions):
        times.append(now)
        now += rng.expovariate(rate) if rate > 0 else 0.0
    return times


def main(argv: list[str] | None = None) -> None:
    import time

    parser = argparse.ArgumentParser(prog="duet simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="a `duet profile` JSON of the same config")
    parser.add_argument("--config", action="append", default=[], required=True, help="a config to simulate (repeat to compare)")
    add_load_arguments(parser)
    parser.add_argument("--json", default=None, help="write the summaries here (duet bench serve's format)")
    parser.add_argument("--measured", default=None, help="a `duet bench serve --json` of the same runs: the errors, run by run")
    parser.add_argument("--plot", default=None, help="write a PNG here (with --measured: predicted against measured)")
    args = parser.parse_args(argv)
    chosen = chosen_workloads(parser, args)
    profile = json.loads(Path(args.profile).read_text())
    rates = [float(rate) for rate in args.rate.split(",")]
    summaries = []
    for config in args.config:
        for (index, rate), workload in itertools.product(enumerate(rates), chosen):
            seed, label = run_seed(args, index, workload), run_label(workload, rate, rates)
            sessions = make_sessions(args, workload, seed)
            started = time.perf_counter()
            simulation = Simulation(cluster_model(config, profile), args.think_time_s)
            results, duration = simulation.run(sessions, arrival_times(len(sessions), rate, seed))
            wall = time.perf_counter() - started
            summaries.append(summarise(Path(config).stem, label, results, duration, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3))
            print(f"{Path(config).stem}/{label}: {duration:.1f} s simulated in {wall:.2f} s ({duration / max(wall, 1e-9):.0f}x real time)")
    print(f"\nsimulated on {args.profile} ({profile['machine']['cpu']})")
    if "transfer" not in profile:
        print("KV transfers taken as free: the profile has no transfer fit (`duet profile --transfer`)")
    print(format_table(summaries))
    predicted = [asdict(summary) for summary in summaries]
    if args.json:
        Path(args.json).write_text(json.dumps(predicted, indent=2))
    pairs = []
    if args.measured:
        pairs = matched(predicted, json.loads(Path(args.measured).read_text()))
        print(format_errors(pairs))
    if args.plot and pairs:
        plot_errors(pairs, args.plot)
    elif args.plot:
        from duet.benchmarks.serve_plots import plot

        plot(summaries, args.plot)


# What a prediction is checked on: (label, where in a summary).
COMPARED = (
    ("TTFT p50", ("percentiles", "ttft_ms", "p50")), ("TTFT p90", ("percentiles", "ttft_ms", "p90")),
    ("TPOT p50", ("percentiles", "tpot_ms", "p50")), ("TPOT p90", ("percentiles", "tpot_ms", "p90")),
    ("E2E p50", ("percentiles", "e2e_ms", "p50")), ("goodput", ("goodput",)), ("req/s", ("request_throughput",)),
)


def _value(summary: dict, path: tuple[str, ...]) -> float:
    for key in path:
        summary = summary[key]
    return float(summary)


def matched(predicted: list[dict], measured: list[dict]) -> list[tuple[dict, dict]]:
    """Predicted and measured summaries of the same config and workload (label), in order."""
    by_run = {(summary["config"], summary["workload"]): summary for summary in measured}
    return [(summary, by_run[key]) for summary in predicted if (key := (summary["config"], summary["workload"])) in by_run]


def errors(pairs: list[tuple[dict, dict]]) -> list[tuple[str, str, list[float | None]]]:
    """Per run: each compared figure's relative error, predicted over measured less one (None where measured is 0)."""
    rows = []
    for predicted, measured in pairs:
        row = []
        for _, path in COMPARED:
            truth = _value(measured, path)
            row.append(None if truth == 0 else _value(predicted, path) / truth - 1)
        rows.append((predicted["config"], predicted["workload"], row))
    return rows


def format_errors(pairs: list[tuple[dict, dict]]) -> str:
    header = f"{'config':<22} {'workload':<20}" + "".join(f" {label:>9}" for label, _ in COMPARED)
    lines = ["predicted against measured (+: the simulation says more):", header]
    for config, workload, row in errors(pairs):
        lines.append(f"{config:<22} {workload:<20}" + "".join(f" {'-' if error is None else f'{error:+.0%}':>9}" for error in row))
    return "\n".join(lines)


def plot_errors(pairs: list[tuple[dict, dict]], path: str) -> None:
    """One panel a figure: each run's predicted value against its measured one, the diagonal and a 10% band."""
    from duet.benchmarks.plots import saved_figure

    columns = 4
    rows = -(-len(COMPARED) // columns)
    with saved_figure(path, figsize=(3.2 * columns, 3.2 * rows), nrows=rows, ncols=columns, squeeze=False) as (figure, grid):
        axes = list(grid.flat)
        for axis in axes[len(COMPARED):]:
            axis.set_visible(False)
        for axis, (label, where) in zip(axes, COMPARED):
            points = [(_value(measured, where), _value(predicted, where), predicted["config"]) for predicted, measured in pairs]
            top = max([max(x, y) for x, y, _ in points] + [1e-9]) * 1.1
            axis.plot([0, top], [0, top], color="gray", linewidth=0.8)
            axis.fill_between([0, top], [0, 0.9 * top], [0, 1.1 * top], color="gray", alpha=0.15)
            for config in dict.fromkeys(config for _, _, config in points):
                axis.scatter(*zip(*[(x, y) for x, y, name in points if name == config]), label=config, s=18)
            axis.set(title=label, xlabel="measured", ylabel="predicted", xlim=(0, top), ylim=(0, top))
        axes[0].legend(fontsize=7)
        figure.suptitle("duet simulate against duet bench serve (band: 10%)")
