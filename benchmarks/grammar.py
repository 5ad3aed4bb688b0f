"""Grammar engines side by side: llguidance (duet's) against xgrammar, on a structured-output workload.

    duet bench grammar [--steps 100] [--batch-sizes 1,32] [--repeats 3] [--threads N] [--seed 0]
                       [--json out.json] [--plot out.png]

With SmolLM2-135M-Instruct's tokenizer (vocabulary 49152), for each engine:

- tokenizer setup: ``xgrammar.TokenizerInfo.from_huggingface`` against ``llguidance.hf.from_tokenizer``;
- cold compile of each constraint in ``grammar_workload.CONSTRAINTS`` (twelve JSON schemas, json_object mode, a regex, a
  choice and a GBNF grammar), best of ``--repeats``: ``compile`` is xgrammar's ``compile_*`` with its
  cache off, and llguidance's ``grammar_from_*`` plus the ``LLMatcher`` that checks the grammar;
  ``first mask`` is a matcher for it and its first mask. llguidance compiles lazily (its lexer's
  states are built as masks ask for them, here and during the first steps of the walk), xgrammar
  eagerly (its token-mask cache is built in ``compile``), so ``total``, the time a request waits
  for its first mask, is the figure to compare;
- per-step mask time at each batch size: every row a matcher on a random walk through its
  constraint (rows start on successive constraints and move to the next when their matcher stops
  or has made ``MAX_WALK`` steps); each step fills the whole batch's bitmask at once (xgrammar's
  ``BatchGrammarMatcher``, llguidance's ``fill_next_token_bitmask_par`` on one ``LLExecutor``),
  then each row takes a uniformly random allowed token (seeded) and accepts it. Only the fill
  is in ``fill``; the accept is timed apart. ``rejected`` counts tokens a mask allowed but the
  matcher refused, ``dead ends`` masks with no token allowed: both should be 0.

Both engines get ``--threads`` (xgrammar's compiler and batch matcher, llguidance's executor). A
constraint an engine refuses is reported as unsupported, with its message, and left out of its walk.
xgrammar is only the comparison: without it, llguidance runs alone.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass, field
from importlib.metadata import version
from pathlib import Path

import numpy as np

from duet.benchmarks.grammar_workload import CONSTRAINTS, Constraint
from duet.benchmarks.plots import saved_figure

VOCAB_SIZE = 49152
MAX_WALK = 64
XGRAMMAR_INSTALL = "pip install xgrammar==0.2.8"


class XGrammar:
    """xgrammar: compiles eagerly into a grammar that every matcher for the constraint shares."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, threads: int) -> None:
        import xgrammar

        self.version = version("xgrammar")
        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.setup_ms = (time.perf_counter() - started) * 1e3
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(threads)
        self.matcher_class, self.batch_class = xgrammar.GrammarMatcher, xgrammar.BatchGrammarMatcher

    def compile(self, constraint: Constraint):
        if constraint.kind == "json":
            return self.compiler.compile_json_schema(constraint.text)
        if constraint.kind == "regex":
            return self.compiler.compile_regex(constraint.text)
        if constraint.kind == "choice":
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in json.loads(constraint.text)))
        return self.compiler.compile_grammar(constraint.text)

    def matcher(self, compiled):
        return self.matcher_class(compiled)

    def fill(self, matchers: list, bitmask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self.batch_class.batch_accept_token(matchers, tokens)

    @staticmethod
    def stopped(matcher) -> bool:
        return matcher.is_terminated()


class LLGuidance:
    """llguidance: a compiled constraint is a checked, unused ``LLMatcher`` that each row copies."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.llguidance, self.numpy = llguidance, llguidance.numpy
        self.version = version("llguidance")
        started = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.setup_ms = (time.perf_counter() - started) * 1e3
        self.executor = llguidance.LLExecutor(threads)

    def compile(self, constraint: Constraint):
        grammar = self.llguidance.grammar_from("gbnf" if constraint.kind == "ebnf" else constraint.kind, constraint.text)
        template = self.llguidance.LLMatcher(self.tokenizer, grammar)
        if template.is_error():
            raise ValueError(template.get_error())
        return template

    @staticmethod
    def matcher(compiled):
        return compiled.deep_copy()

    def fill(self, matchers: list, bitmask: np.ndarray) -> None:
        self.numpy.fill_next_token_bitmask_par(self.executor, [(matcher, row) for row, matcher in enumerate(matchers)], bitmask)

    def accept(self, matchers: list, tokens: list[int]) -> list[bool]:
        return self.numpy.consume_token_par(self.executor, list(zip(matchers, tokens)))

    @staticmethod
    def stopped(matcher) -> bool:
        return matcher.is_stopped()


@dataclass
class CompileTime:
    constraint: str
    kind: str
    compile_ms: float | None = None  # None: unsupported, and `error` says why
    first_mask_ms: float | None = None
    error: str | None = None

    @property
    def total_ms(self) -> float | None:
        return None if self.compile_ms is None else self.compile_ms + self.first_mask_ms


@dataclass
class StepTimes:
    batch_size: int
    steps: int
    fill_ms: dict[str, float]  # mean, p50, p99 over steps
    accept_ms: dict[str, float]
    walks_stopped: int  # walks that reached the grammar's end and its stop token
    rejected: int
    dead_ends: int


@dataclass
class EngineResult:
    engine: str
    version: str
    threads: int
    setup_ms: float
    compiles: list[CompileTime] = field(default_factory=list)
    steps: list[StepTimes] = field(default_factory=list)


def time_compiles(engine, repeats: int) -> tuple[list[CompileTime], dict[str, object]]:
    """Best-of-``repeats`` cold compile and first mask of each constraint, and a compiled form of each supported one."""
    bitmask = np.zeros((1, (VOCAB_SIZE + 31) // 32), dtype=np.int32)
    times, compiled = [], {}
    for constraint in CONSTRAINTS:
        compile_ms, first_mask_ms, error = [], [], None
        try:
            for _ in range(repeats):
                started = time.perf_counter()
                compiled[constraint.name] = engine.compile(constraint)
                compiled_at = time.perf_counter()
                engine.fill([engine.matcher(compiled[constraint.name])], bitmask)
                compile_ms.append((compiled_at - started) * 1e3)
                first_mask_ms.append((time.perf_counter() - compiled_at) * 1e3)
        except Exception as refusal:  # an engine refusing a constraint is a finding, not a crash
            error = f"{type(refusal).__name__}: {refusal}".strip()
            compiled.pop(constraint.name, None)
        result = CompileTime(constraint.name, constraint.kind, error=error)
        if error is None:
            result.compile_ms, result.first_mask_ms = min(compile_ms), min(first_mask_ms)
        times.append(result)
    return times, compiled


def _summary(samples_ms: list[float]) -> dict[str, float]:
    return {"mean": float(np.mean(samples_ms))} | {f"p{q}": float(np.percentile(samples_ms, q)) for q in (50, 99)}


def time_steps(engine, compiled: dict[str, object], batch_size: int, steps: int, seed: int) -> StepTimes:
    """Every row a random walk through its constraint; the batch's mask fill and accept timed per step."""
    rng = np.random.default_rng(seed)
    names = list(compiled)
    constraint_of = [row % len(names) for row in range(batch_size)]
    matchers = [engine.matcher(compiled[names[index]]) for index in constraint_of]
    walked = [0] * batch_size
    bitmask = np.zeros((batch_size, (VOCAB_SIZE + 31) // 32), dtype=np.int32)
    fill_ms, accept_ms, stopped, rejected, dead_ends = [], [], 0, 0, 0

    def next_walk(row: int) -> None:
        constraint_of[row] = (constraint_of[row] + 1) % len(names)
        matchers[row] = engine.matcher(compiled[names[constraint_of[row]]])
        walked[row] = 0

    for _ in range(steps):
        started = time.perf_counter()
        engine.fill(matchers, bitmask)
        fill_ms.append((time.perf_counter() - started) * 1e3)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB_SIZE]
        rows, tokens = [], []
        for row in range(batch_size):
            choices = np.flatnonzero(allowed[row])
            if len(choices) == 0:
                dead_ends += 1
                next_walk(row)
            else:
                rows.append(row)
                tokens.append(int(choices[rng.integers(len(choices))]))
        started = time.perf_counter()
        accepted = engine.accept([matchers[row] for row in rows], tokens)
        accept_ms.append((time.perf_counter() - started) * 1e3)
        rejected += len(accepted) - sum(accepted)
        for row, ok in zip(rows, accepted):
            walked[row] += 1
            ended = ok and engine.stopped(matchers[row])
            stopped += ended
            if not ok or ended or walked[row] >= MAX_WALK:
                next_walk(row)
    return StepTimes(batch_size, steps, _summary(fill_ms), _summary(accept_ms), stopped, rejected, dead_ends)


def load_engines(tokenizer, threads: int) -> list:
    engines = []
    for engine_class in (LLGuidance, XGrammar):
        try:
            engines.append(engine_class(tokenizer, VOCAB_SIZE, threads))
        except ImportError:
            install = XGRAMMAR_INSTALL if engine_class is XGrammar else "pip install llguidance"
            print(f"{engine_class.name} is not installed, so it is left out; `{install}` to measure it too")
    if not engines:
        raise SystemExit("neither grammar engine is installed: `pip install llguidance` (and `pip install xgrammar==0.2.8`)")
    return engines


def run(batch_sizes: list[int], steps: int, repeats: int, threads: int, seed: int) -> list[EngineResult]:
    from transformers import AutoTokenizer

    from duet.models.loader import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path("smollm2")))
    results = []
    for engine in load_engines(tokenizer, threads):
        result = EngineResult(engine.name, engine.version, threads, engine.setup_ms)
        result.compiles, compiled = time_compiles(engine, repeats)
        if compiled:  # an engine that refused every constraint has nothing to walk
            result.steps = [time_steps(engine, compiled, batch_size, steps, seed) for batch_size in batch_sizes]
        results.append(result)
    return results


def report(result: EngineResult) -> str:
    lines = [
        f"\n{result.engine} {result.version}: tokenizer setup {result.setup_ms:.1f} ms, {result.threads} threads",
        f"{'constraint':<18} {'kind':<7} {'compile ms':>10} {'first mask ms':>13} {'total ms':>9}",
    ]
    for c in result.compiles:
        if c.error is None:
            lines.append(f"{c.constraint:<18} {c.kind:<7} {c.compile_ms:>10.2f} {c.first_mask_ms:>13.2f} {c.total_ms:>9.2f}")
        else:
            lines.append(f"{c.constraint:<18} {c.kind:<7} unsupported: {c.error.splitlines()[0][:100]}")
    lines.append(
        f"{'batch':>5} {'steps':>5} {'fill mean':>9} {'p50':>7} {'p99':>7} {'accept mean':>11} {'p50':>7} {'p99':>7}"
        f" {'walks stopped':>13} {'rejected':>8} {'dead ends':>9}   (ms per step)"
    )
    for s in result.steps:
        lines.append(
            f"{s.batch_size:>5} {s.steps:>5} {s.fill_ms['mean']:>9.3f} {s.fill_ms['p50']:>7.3f} {s.fill_ms['p99']:>7.3f}"
            f" {s.accept_ms['mean']:>11.3f} {s.accept_ms['p50']:>7.3f} {s.accept_ms['p99']:>7.3f}"
            f" {s.walks_stopped:>13} {s.rejected:>8} {s.dead_ends:>9}"
        )
    return "\n".join(lines)


def plot(results: list[EngineResult], path: str) -> None:
    colors = {"llguidance": "#3b7dd8", "xgrammar": "#e08a2c"}
    width = 0.8 / len(results)
    with saved_figure(path, figsize=(14, 7), ncols=2, gridspec_kw={"width_ratios": [2, 1]}) as (fig, (compiles, steps)):
        names = [c.name for c in CONSTRAINTS]
        for index, result in enumerate(results):
            positions = np.arange(len(names)) + index * width
            totals = [c.total_ms or 0.0 for c in result.compiles]
            compiles.barh(positions, totals, height=width, color=colors[result.engine], label=result.engine)
            for y, c in zip(positions, result.compiles):
                if c.error is not None:
                    compiles.text(0, y, " unsupported", va="center", fontsize=8, color=colors[result.engine])
            batches = np.arange(len(result.steps)) + index * width
            means = [s.fill_ms["mean"] for s in result.steps]
            steps.bar(batches, means, width=width, color=colors[result.engine], label=result.engine)
            for x, s in zip(batches, result.steps):
                steps.text(x, s.fill_ms["mean"], f"{s.fill_ms['mean']:.3f}", ha="center", va="bottom", fontsize=8)
        compiles.set_yticks(np.arange(len(names)) + width * (len(results) - 1) / 2, names)
        compiles.invert_yaxis()
        compiles.set_xscale("symlog", linthresh=1.0)
        compiles.set_xlabel("cold compile + first mask (ms)")
        compiles.set_title("time to a constraint's first mask")
        compiles.legend()
        batch_labels = [f"batch {size}" for size in sorted({s.batch_size for result in results for s in result.steps})]
        steps.set_xticks(np.arange(len(batch_labels)) + width * (len(results) - 1) / 2, batch_labels)
        steps.set_ylabel("mask fill per step, mean (ms)")
        steps.set_title("per-step mask fill")
        steps.legend()
        fig.suptitle(f"grammar engines, SmolLM2-135M tokenizer (vocab {VOCAB_SIZE})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="duet bench grammar", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=100, help="mask steps per batch size")
    parser.add_argument("--batch-sizes", default="1,32", help="comma-separated batch sizes of the per-step mask walk")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many cold compiles per constraint")
    parser.add_argument(
        "--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2),
        help="threads each engine may use (default: half the cores, xgrammar's own default, leaving the caller's core free)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random walks")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--plot", help="PNG chart (default: beside --json, else grammar.png here)")
    args = parser.parse_args(argv)
    batch_sizes = [int(size) for size in args.batch_sizes.split(",") if size.strip()]
    if not batch_sizes or min(batch_sizes) < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--batch-sizes, --steps and --repeats must be positive")
    results = run(batch_sizes, args.steps, args.repeats, args.threads, args.seed)
    for result in results:
        print(report(result))
    if args.json:
        with open(args.json, "w") as file:
            json.dump([asdict(result) for result in results], file, indent=2)
    plot_path = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else "grammar.png")
    print()
    plot(results, plot_path)
    return 0


if __name__ == "__main__":
    main()
