"""``duet simulate``'s events in simulated time: sessions arriving, replicas' steps ending, KV
transfers arriving, the replicas' reports and the router's waiting room asking its own
``StageBalancer`` where each context is computed. A step starting takes longer by
``cpu_stretch`` of the engines' threads stepping and the serving path's cores: its base, and its
CPU per request, prompt token and streamed token spread over the last ``SERVING_WINDOW_S``, and
by how much slower a served engine computes than the profile's alone (``engine_factor``); a
request reaches the router's admission after the serving path's latency."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field

from duet.benchmarks.serve import RequestResult
from duet.benchmarks.sim_model import TOKEN, ClusterModel, Replica, cpu_stretch
from duet.benchmarks.sim_moves import Moves
from duet.benchmarks.sim_roles import Roles
from duet.benchmarks.sim_scale import DEFAULT_START_S, Autoscaling
from duet.benchmarks.workloads import TurnSpec
from duet.messages import ROUTING_STATS_PERIOD_S
from duet.router.waiting import ROOM_WAIT_S, WAIT_POLL_S

SERVING_WINDOW_S = 1.0  # the serving path's recent CPU, as a rate over this long


@dataclass
class Sequence:
    """One request as its client sees it."""

    spec: TurnSpec
    session: int
    turn: int
    sent_s: float
    token_times: list[float] = field(default_factory=list)
    failed_at: float | None = None  # when its client got a 503


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

    def __init__(self, cluster: ClusterModel, think_time_s: float = 0.0, start_s: float = DEFAULT_START_S) -> None:
        from duet.router.arrivals import ArrivalMeter
        from duet.router.balance import StageBalancer

        self.cluster, self.think_time_s = cluster, think_time_s
        self.now = 0.0
        clock = self.clock
        stage = "colocated" if cluster.colocated else "decode"
        self.prefill = [Replica(f"prefill-{i}", "prefill", model, clock) for i, model in enumerate(cluster.prefill)]
        self.decode = [Replica(f"{stage}-{i}", stage, model, clock) for i, model in enumerate(cluster.decode)]
        self._reports: dict[str, list] = {"prefill": [], "decode": []}  # the last reports, by the role each replica served
        self.reported: dict[str, object] = {}  # replica name -> its last report
        self.roles = Roles(self, cluster.roles, cluster.ttft_s, cluster.tpot_s)
        self.moves = Moves(self)
        stats = (lambda role: self._reports[role] or None) if cluster.adaptive_local_prefill else (lambda role: None)
        self.balancer = StageBalancer(
            stats, lambda role: len(self.roles.serving(role)), cluster.local_prefill_threshold, cluster.ttft_s, cluster.tpot_s, clock=clock
        )
        self.until = 0.0  # periodic work (``every``) goes on until then, and while requests remain
        self._events: list = []
        self._order = itertools.count()
        self._transfer_ids = itertools.count(1)
        self._receivers: dict[int, Replica] = {}  # transfer id -> the decode replica its KV goes to
        self._choices: dict[str, object] = {}  # request id -> the balancer's choice, until its first token
        self.sequences: dict[str, Sequence] = {}
        self._admission: list[str] = []  # past max_running_sequences: waiting for a slot, in order
        self._contexts: list[_Context] = []  # admitted, waiting for the balancer's choice
        self._running = 0  # admitted and not ended
        self._open = 0  # requests of the sessions not ended yet (sent or still to come)
        self._polling = False
        self._sessions: dict[int, list[TurnSpec]] = {}
        self._serving: deque[tuple[float, float]] = deque()  # (when, CPU seconds) the serving path spent
        self._serving_spent = 0.0  # their sum
        self.arrivals = ArrivalMeter(clock)  # the router's, metering each admitted sequence
        self._tickets: dict[str, int] = {}
        self.draining: list[Replica] = []  # left their pools (scaled down): finishing what they have
        self.autoscaling = Autoscaling(self, cluster.scaling, start_s) if cluster.scaling else None

    def clock(self) -> float:
        return self.now

    def at(self, when: float, action, *args) -> None:
        heapq.heappush(self._events, (when, next(self._order), action, args))

    def run(self, sessions: list[list[TurnSpec]], arrivals: list[float], until: float = 0.0) -> tuple[list[RequestResult], float]:
        """The sessions sent at their arrival times; each request's result and when the last
        ended. Autoscaled pools keep deciding until ``until`` (and while requests remain)."""
        for index, (turns, when) in enumerate(zip(sessions, arrivals)):
            self._sessions[index] = turns
            self._open += len(turns)
            self.at(when, self._arrive, index, 0)
        self.until = until
        if self.prefill:
            self.every(ROUTING_STATS_PERIOD_S, self._report)
            self.roles.start()
        if self.autoscaling is not None:
            self.autoscaling.start()
        while self._events:
            self.now, _, action, args = heapq.heappop(self._events)
            action(*args)
        results = [self._result(sequence) for sequence in self.sequences.values()]
        ended = [sequence for sequence in self.sequences.values() if sequence.failed_at or sequence.token_times]
        end = max((sequence.failed_at or sequence.token_times[-1] for sequence in ended), default=0.0)
        return sorted(results, key=lambda result: result.sent_s), end

    def every(self, period: float, action) -> None:
        """``action`` now and every ``period`` after, until ``until`` and while requests remain."""
        def run() -> None:
            action()
            if self.now < self.until or self._open:
                self.at(self.now + period, run)

        self.at(self.now, run)

    def waiting_tokens(self) -> int:
        """The context tokens admitted and waiting in the router for a pool with room."""
        return sum(context.num_tokens for context in self._contexts)

    def retire(self, replica: Replica) -> None:
        """``replica`` leaves its pool (scaled down): nothing new goes to it; the sequences it
        decodes move away (``sim_moves``), its prompts in flight finish there."""
        (self.prefill if replica in self.prefill else self.decode).remove(replica)
        self.draining.append(replica)
        self.moves.leave(replica)

    def new_transfer_id(self) -> int:
        return next(self._transfer_ids)

    def send_kv(self, sender: Replica, receiver: Replica, transfer_id: int, tokens: int) -> None:
        """``tokens`` of KV from ``sender`` to the blocks ``receiver`` reserved as ``transfer_id``."""
        self._receivers[transfer_id] = receiver
        self.at(self.now + self._transfer_s(tokens), self._arrived, sender, transfer_id)

    def _report(self) -> None:
        """Every replica's stats, as they reach the router every ``ROUTING_STATS_PERIOD_S``."""
        self.reported = {replica.name: replica.report() for replica in (*self.prefill, *self.decode)}
        self._reports = {role: [stats for stats in self.reported.values() if stats.stage == role] for role in ("prefill", "decode")}

    def _spend(self, requests: int = 0, prompt_tokens: int = 0, tokens: int = 0) -> None:
        """The serving path's CPU for ``requests`` arriving, ``prompt_tokens`` (a colocated
        request's as it arrives; through PD, a context's as its KV moves) and ``tokens`` streamed now."""
        fit = self.cluster.serving
        if fit:
            spent = fit["per_request_s"] * requests + fit["per_prompt_token_s"] * prompt_tokens + fit["per_token_s"] * tokens
            self._serving.append((self.now, spent))
            self._serving_spent += spent

    def serving_cores(self) -> float:
        """The cores the serving path uses now: its base and its recent CPU's rate."""
        fit = self.cluster.serving
        if not fit:
            return 0.0
        while self._serving and self._serving[0][0] < self.now - SERVING_WINDOW_S:
            self._serving_spent -= self._serving.popleft()[1]
        return fit["base_cores"] + max(0.0, self._serving_spent) / SERVING_WINDOW_S

    def _arrive(self, session: int, turn: int) -> None:
        """A request sent: it reaches the router's admission after the serving path's latency."""
        request_id = f"s{session}-t{turn}"
        self._spend(requests=1, prompt_tokens=len(self._sessions[session][turn].prompt) if self.cluster.colocated else 0)
        self.sequences[request_id] = Sequence(self._sessions[session][turn], session, turn, self.now)
        latency = (self.cluster.serving or {}).get("latency_s", 0.0)
        if latency:
            self.at(self.now + latency, self._reach, request_id)
        else:
            self._reach(request_id)

    def _reach(self, request_id: str) -> None:
        self._admission.append(request_id)
        self.admit()

    def admit(self) -> None:
        """Admission (``max_running_sequences``), then the waiting room's choices."""
        while self._admission and self._running < self.cluster.max_running:
            request_id = self._admission.pop(0)
            self._running += 1
            spec = self.sequences[request_id].spec
            self._tickets[request_id] = self.arrivals.arrive(len(spec.prompt), spec.output_len)
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
                if choice.local:
                    self._place_local(context.request_id, choice)
                else:
                    self._place_remote(context.request_id, choice)
        expired = [context for context in self._contexts if self.now - context.since >= ROOM_WAIT_S]
        for context in expired:  # the clients get a 503; each end admits more (this method again), so out of the list first
            self._contexts.remove(context)
            self.sequences[context.request_id].failed_at = self.now
        for context in expired:
            self._ended(context.request_id, ok=False)
        if self._contexts and not self._polling:
            self._polling = True
            self.at(self.now + WAIT_POLL_S, self._poll)

    def _poll(self) -> None:
        self._polling = False
        self.admit()

    def _params(self, request_id: str):
        from duet.sampling_params import SamplingParams

        length = self.sequences[request_id].spec.output_len
        return SamplingParams(temperature=0.0, max_tokens=length, min_tokens=length, ignore_eos=True)

    def _place_local(self, request_id: str, choice) -> None:
        from duet.request import Request

        decode = self.decode_replica()
        prompt = self.sequences[request_id].spec.prompt
        decode.scheduler.add_request(Request(request_id, prompt, self._params(request_id), None, arrival_time=self.now))
        if choice is not None:
            self._choices[request_id] = choice
        self.kick(decode)

    def _place_remote(self, request_id: str, choice) -> None:
        from duet.messages import KVDestination
        from duet.request import Request
        from duet.sampling_params import SamplingParams

        prompt = self.sequences[request_id].spec.prompt
        decode = self.decode_replica()
        transfer_id = self.new_transfer_id()
        request = Request(request_id, prompt, self._params(request_id), None, arrival_time=self.now)
        if not decode.scheduler.add_remote_request(request, transfer_id):
            choice.done()  # no room for its KV: it waits again, first in line
            self._contexts.insert(0, _Context(request_id, len(prompt), self.sequences[request_id].sent_s))
            return
        self._receivers[transfer_id] = decode
        self._choices[request_id] = choice
        prefill = self.roles.pick(
            "prefill", lambda member: member.prompt_tokens_pending, lambda replica: replica.scheduler.stats().prompt_tokens_pending
        )
        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        send = KVDestination(transfer_id, (), "decode")
        prefill.scheduler.add_request(Request(request_id, prompt, first, None, kv_send=send, arrival_time=self.now))
        self.kick(prefill)

    def busy_threads(self) -> int:
        """The threads computing now: the engines' of the replicas stepping, and one for each
        replica starting (loading its model and weights)."""
        busy = sum(replica.model.threads for replica in (*self.prefill, *self.decode, *self.draining) if replica.busy)
        return busy + (self.autoscaling.num_starting() if self.autoscaling is not None else 0)

    def stretch(self, threads: int) -> float:
        """How much longer work takes with ``threads`` computing now (``cpu_stretch``)."""
        return cpu_stretch(threads, self.serving_cores(), self.cluster.cores)

    def decode_replica(self, exclude: Replica | None = None) -> Replica | None:
        """Where a sequence decodes: the router's choice among the replicas serving decode (the
        decode pool's own ranks by sequences, then fewer free blocks: ``Replica.busyness``), but
        ``exclude``; None if there is none."""
        role = "colocated" if self.cluster.colocated else "decode"
        return self.roles.pick(role, lambda member: member.load, Replica.busyness, exclude)

    def kick(self, replica: Replica) -> None:
        """``replica`` steps, if it is idle and has something to do."""
        if not replica.busy:
            others = [other for other in (*self.prefill, *self.decode, *self.draining) if other.busy and other is not replica]
            # a served engine's step: the profile's, slower by the serving path's share and the
            # profile's ``engine_factor`` (1 without one)
            factor = (self.cluster.serving or {}).get("engine_factor", 1.0)
            seconds = replica.start(len(others), factor * self.stretch(self.busy_threads() + replica.model.threads))
            if seconds is not None:
                self.at(self.now + seconds, self._finished_step, replica)

    def _finished_step(self, replica: Replica) -> None:
        for request in replica.finish():
            sequence = self.sequences[request.request_id]
            if request.kv_send is not None:  # a prompt computed for a replica serving decode
                if request.output_token_ids and not sequence.token_times:
                    sequence.token_times.append(self.now)  # the router streams the first token on
                    self._spend(tokens=1)
                    self._first_token(request.request_id)
                    replica.prompts_sent += 1
                    tokens = len(request.prompt_token_ids)
                    self._spend(prompt_tokens=tokens)
                    self.send_kv(replica, self._receivers[request.kv_send.transfer_id], request.kv_send.transfer_id, tokens)
                continue
            new = len(request.output_token_ids) - len(sequence.token_times)
            if new > 0:
                sequence.token_times += [self.now] * new
                self._spend(tokens=new)
                self.arrivals.progress(self._tickets[request.request_id], len(sequence.token_times))
                self._first_token(request.request_id)
            if request.is_finished:
                self._ended(request.request_id)
        self.moves.after_step(replica)
        self.kick(replica)

    def _first_token(self, request_id: str) -> None:
        choice = self._choices.pop(request_id, None)
        if choice is not None:
            choice.done(first_token=True)
            if self._contexts:
                self.admit()

    def _transfer_s(self, tokens: int) -> float:
        fit = self.cluster.transfer
        return 0.0 if fit is None else fit["base_s"] + fit["per_token_s"] * tokens

    def _arrived(self, sender: Replica, transfer_id: int) -> None:
        from duet.outputs import KVTransferResult

        sender.kv_results.append(KVTransferResult(transfer_id, ok=True))
        self.kick(sender)
        receiver = self._receivers.pop(transfer_id)
        receiver.kv_results.append(KVTransferResult(transfer_id, ok=True, first_token_id=TOKEN))
        self.kick(receiver)

    def _ended(self, request_id: str, ok: bool = True) -> None:
        """A request done (or failed: its session goes no further, as in ``duet bench serve``)."""
        sequence = self.sequences[request_id]
        self._running -= 1
        self.arrivals.end(self._tickets.pop(request_id), ok)
        later_turns = len(self._sessions[sequence.session]) - sequence.turn - 1
        self._open -= 1 if ok else 1 + later_turns
        if ok and later_turns:
            self.at(self.now + self.think_time_s, self._arrive, sequence.session, sequence.turn + 1)
        self.admit()

    def _result(self, sequence: Sequence) -> RequestResult:
        times = sequence.token_times
        if len(times) < sequence.spec.output_len:
            error = "not served: no room within the wait (503), or none ever"
            return RequestResult(ok=False, turn=sequence.turn, sent_s=sequence.sent_s, error=error)
        return RequestResult(
            ok=True, turn=sequence.turn, prompt_tokens=len(sequence.spec.prompt), sent_s=sequence.sent_s,
            ttft=times[0] - sequence.sent_s, tt2t=(times[1] if len(times) > 1 else times[0]) - sequence.sent_s,
            e2e=times[-1] - sequence.sent_s, itls=inter_token_latencies(times), output_tokens=len(times),
        )


def inter_token_latencies(times: list[float]) -> list[float]:
    """Each token's latency after the first step's, as ``duet bench serve``'s client counts it:
    the tokens a step streams together (drafts) share the gap before them."""
    steps = [(when, len(list(tokens))) for when, tokens in itertools.groupby(times)]
    return [(when - last) / count for (last, _), (when, count) in zip(steps, steps[1:]) for _ in range(count)]
