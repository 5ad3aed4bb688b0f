"""The ledger of ``duet bench soak``: how each request ended, what was wrong with it, and the
checks over all of them (see ``duet.benchmarks.soak``)."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from duet.benchmarks.plots import saved_figure

STATUSES = ("completed", "cancelled", "rejected", "failed")


@dataclass
class Outcome:
    """How one request ended, as its client saw it."""

    index: int
    sent_at: float
    status: str = "pending"  # until it ends: then one of STATUSES
    reason: str = ""  # why it failed or was rejected (the error body's message)
    http_status: int = 200
    latency_s: float = 0.0
    ttft_s: float | None = None
    tokens: dict[int, list[int]] = field(default_factory=dict)  # per choice
    finish: dict[int, list[str]] = field(default_factory=dict)  # per choice: every finish_reason it was sent
    usage: int | None = None  # completion tokens the response reported
    problems: list[str] = field(default_factory=list)  # where it broke the ledger's rules


def check_choices(outcome: Outcome, n: int, max_tokens: int) -> None:
    """A completed request: ``n`` choices, each finished once with the tokens its reason allows,
    and a usage that adds them up."""
    if sorted(outcome.finish) != list(range(n)):
        outcome.problems.append(f"finished choices {sorted(outcome.finish)} for n={n}")
    for index, reasons in outcome.finish.items():
        got = len(outcome.tokens.get(index, []))
        if reasons not in (["length"], ["stop"]):
            outcome.problems.append(f"choice {index} finished as {reasons}")
        elif reasons == ["length"] and got != max_tokens:
            outcome.problems.append(f"choice {index} ended for length with {got} tokens, max_tokens={max_tokens}")
        elif got > max_tokens:
            outcome.problems.append(f"choice {index} has {got} tokens, max_tokens={max_tokens}")
    total = sum(len(tokens) for tokens in outcome.tokens.values())
    if outcome.usage is not None and outcome.usage != total:
        outcome.problems.append(f"usage says {outcome.usage} completion tokens, the choices have {total}")


class Ledger:
    def __init__(self, counters_before: dict[str, dict[str, float]]) -> None:
        self.counters_before = counters_before
        self.counters_after: dict[str, dict[str, float]] = {}
        self.jobs: dict[int, object] = {}
        self.outcomes: list[Outcome] = []
        self.kills: list[tuple[float, str]] = []  # (seconds into the run, replica)
        self.samples: list = []
        self.origin = 0.0
        self.drained_s = 0.0
        self.integrity: dict = {}
        self.final_kv_usage: dict[str, float] = {}

    def add(self, job, outcome: Outcome) -> None:
        if job.index in self.jobs:
            outcome.problems.append("ended twice")
        self.jobs[job.index] = job
        self.outcomes.append(outcome)

    @property
    def counts(self) -> dict[str, int]:
        found = Counter(outcome.status for outcome in self.outcomes)
        return {status: found[status] for status in STATUSES}

    def greedy_mismatches(self) -> list[str]:
        """Greedy requests of one prompt and max_tokens must agree token for token."""
        seen: dict[tuple, list[int]] = {}
        mismatches = []
        for outcome in self.outcomes:
            job = self.jobs[outcome.index]
            if outcome.status != "completed" or not job.greedy:
                continue
            for tokens in outcome.tokens.values():
                key = (tuple(job.prompt), job.max_tokens)
                expected = seen.setdefault(key, tokens)
                # A choice that stopped early (EOS) is a prefix of the others' tokens or equal.
                shorter, longer = sorted((tokens, expected), key=len)
                if longer[: len(shorter)] != shorter:
                    mismatches.append(f"request {outcome.index}: greedy tokens differ from an earlier answer to its prompt")
        return mismatches

    def server_mismatches(self) -> list[str]:
        """The router's counts of finished choices (by reason) and rejections against the
        clients'. A request its client gave up on may still have finished in the router (its
        last events were on the way), so those choices may add to the router's count, and a
        plain one may have been refused (429); nothing else may. A 503 also answers a request whose pools failed it after admission, which the
        router does not count as a rejection: its 503s may be fewer than the clients saw."""
        def delta(name: str, label: str) -> Counter:
            before, after = self.counters_before.get(name, {}), self.counters_after.get(name, {})
            found = Counter()
            for labels, value in after.items():
                found[_label(labels, label)] += int(value - before.get(labels, 0.0))
            return +found

        mismatches = []
        completed = [o for o in self.outcomes if o.status == "completed"]
        clients = Counter(reasons[0] for o in completed for reasons in o.finish.values())
        may_add = sum(self.jobs[o.index].n for o in self.outcomes if o.status == "cancelled")
        server = delta("vllm:request_success_total", "finished_reason")
        if any(server[reason] < clients[reason] for reason in clients) or sum(server.values()) > sum(clients.values()) + may_add:
            mismatches.append(
                f"finished choices: the router counted {dict(server)}, the clients saw {dict(clients)} (and cancelled {may_add})"
            )
        rejected = Counter(str(o.http_status) for o in self.outcomes if o.status == "rejected")
        server_rejected = delta("duet:requests_rejected_total", "status")
        # A plain request its client gave up on (after 0.1-0.8 s) may have been refused meanwhile,
        # its 429 still on the way; a stream given up on had its events: it was admitted.
        may_reject = sum(1 for o in self.outcomes if o.status == "cancelled" and not self.jobs[o.index].stream)
        if not rejected["429"] <= server_rejected["429"] <= rejected["429"] + may_reject or server_rejected["503"] > rejected["503"]:
            mismatches.append(f"rejections: the router counted {dict(server_rejected)}, the clients saw {dict(rejected)}")
        return mismatches

    @property
    def leaked_blocks_share(self) -> float:
        return sum(self.final_kv_usage.values())

    def violations(self) -> list[str]:
        found = [f"request {o.index}: {problem}" for o in self.outcomes for problem in o.problems]
        found += [f"request {o.index} failed without a reason" for o in self.outcomes if o.status == "failed" and not o.reason]
        found += [f"request {o.index} ended as {o.status!r}" for o in self.outcomes if o.status not in STATUSES]
        found += self.greedy_mismatches() + self.server_mismatches()
        if not self.integrity.get("ok"):
            found.append(f"integrity: {self.integrity}")
        if not self.final_kv_usage or self.leaked_blocks_share:
            found.append(f"KV usage at the end: {self.final_kv_usage}")
        return found

    @property
    def exact(self) -> bool:
        return not self.violations()

    def figures(self) -> dict:
        completed = [o for o in self.outcomes if o.status == "completed"]
        latencies = sorted(o.latency_s for o in completed)
        ttfts = sorted(o.ttft_s for o in completed if o.ttft_s is not None)
        return {
            "requests": len(self.outcomes),
            **self.counts,
            "failed_reasons": dict(Counter(o.reason[:120] for o in self.outcomes if o.status == "failed").most_common(5)),
            "rejected_by_status": dict(Counter(o.http_status for o in self.outcomes if o.status == "rejected")),
            "choices_completed": sum(len(o.finish) for o in completed),
            "tokens_completed": sum(len(t) for o in completed for t in o.tokens.values()),
            "latency_p50_s": _quantile(latencies, 0.5),
            "latency_p99_s": _quantile(latencies, 0.99),
            "ttft_p50_s": _quantile(ttfts, 0.5),
            "ttft_p99_s": _quantile(ttfts, 0.99),
            "kills": [name for _, name in self.kills],
            "drained_s": round(self.drained_s, 1),
            "kv_usage_at_end": self.final_kv_usage,
            "integrity_ok": bool(self.integrity.get("ok")),
            "violations": self.violations(),
        }

    def report(self) -> str:
        f = self.figures()
        lines = [
            f"requests {f['requests']}: completed {f['completed']}, cancelled {f['cancelled']}, "
            f"rejected {f['rejected']} {f['rejected_by_status']}, failed {f['failed']}",
            f"completed choices {f['choices_completed']} ({f['tokens_completed']} tokens); latency p50 {f['latency_p50_s']:.2f} s, "
            f"p99 {f['latency_p99_s']:.2f} s; TTFT p50 {f['ttft_p50_s']:.2f} s, p99 {f['ttft_p99_s']:.2f} s",
        ]
        if f["failed_reasons"]:
            lines.append(f"failed with: {f['failed_reasons']}")
        if f["kills"]:
            lines.append(f"replicas killed: {len(f['kills'])} ({', '.join(f['kills'])})")
        leaked = "0" if not self.leaked_blocks_share else f"KV usage {self.final_kv_usage}"
        lines.append(f"after {f['drained_s']} s idle: leaked blocks {leaked}, integrity {'ok' if f['integrity_ok'] else 'FAILED'}")
        violations = f["violations"]
        lines.append("ledger exact" if not violations else f"ledger NOT exact: {len(violations)} violations")
        lines += [f"  {violation}" for violation in violations[:20]]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        with saved_figure(path, figsize=(12, 7), dpi=110, what="timeline", nrows=2, ncols=1, sharex=True) as (figure, (top, bottom)):
            for status, color in (("completed", "tab:blue"), ("cancelled", "tab:gray"), ("rejected", "tab:orange"), ("failed", "tab:red")):
                chosen = [o for o in self.outcomes if o.status == status]
                top.scatter([o.sent_at - self.origin for o in chosen], [o.latency_s for o in chosen], s=6, color=color, label=status)
            top.set_ylabel("end-to-end latency (s)")
            top.legend(fontsize=8, loc="upper left")
            times = [sample.at for sample in self.samples]
            bottom.plot(times, [sample.in_flight for sample in self.samples], color="tab:purple", label="requests in flight")
            bottom.set_ylabel("requests in flight")
            usage_axis = bottom.twinx()
            usage_axis.plot(times, [max(sample.kv_usage.values(), default=0.0) for sample in self.samples], color="tab:green",
                            label="KV usage (busiest replica)")
            usage_axis.set_ylabel("KV usage")
            usage_axis.set_ylim(0, 1)
            for axis in (top, bottom):
                for at, _ in self.kills:
                    axis.axvline(at, color="tab:red", linestyle="--", linewidth=0.8)
            bottom.set_xlabel("seconds (dashed: a replica killed)")
            lines = bottom.get_lines()[:1] + usage_axis.get_lines()[:1]
            bottom.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="upper left")


def _label(labels: str, name: str) -> str:
    for part in labels.split(","):
        key, _, value = part.partition("=")
        if key == name:
            return value.strip('"')
    return ""


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[int(q * 100) - 1] if len(values) > 1 else values[0]
