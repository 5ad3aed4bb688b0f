"""The runner's side of structured outputs: a matcher per constrained request and each step's masks.

A request's matcher is built the first time the runner samples for it, and fed the request's
output so far: a request resumed after preemption, a decode replica's request whose first token
the prefill replica sampled under the same constraint, and a sequence migrated from another
decode replica all continue from the state after their last token. The step's masks (one row
per logits row: a request's next token, and with speculation one more per draft, each from the
state after the drafts before it) are filled by llguidance. With the forward pass on a GPU they
are filled on a thread of their own meanwhile (llguidance releases the GIL while it computes);
on a CPU the forward pass keeps every core busy, and a thread beside it stalls it (measured on 2
cores: +12 ms a step at batch 1, +42% at batch 32, against +0.3 ms and +5% filled in line), so
there they are filled in line. Requests without a constraint cost nothing: no matcher, no mask row.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from duet.kernels.token_bitmask import apply_token_bitmask
from duet.structured_output import first_line, grammar_tokenizer

if TYPE_CHECKING:
    from duet.runner_state import CachedRequestState


# Compiled grammars a runner keeps; a schema used again starts its requests from a copy.
COMPILED_GRAMMARS = 64


class GrammarError(RuntimeError):
    """A constrained request cannot go on under its grammar (llguidance refused a token or hit
    one of its limits): the runner reports it, and the engine fails that request alone."""


@dataclass
class MaskJob:
    """One step's masks being filled: ``rows`` are the logits rows they cover, in order."""

    rows: list[int]
    future: Future


class GrammarMasks:
    """Matchers of the runner's constrained requests, keyed by request id."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_id: int | None, overlap: bool) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._mask_executor = None  # llguidance's own threads, filling a batch's rows in parallel
        self._matchers: dict[str, object] = {}
        self._failures: dict[str, str] = {}  # request id -> why its constraint cannot go on
        self._pristine: dict[str, object] = {}  # grammar text -> its matcher at the start, least recently used first
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks") if overlap else None
        # Where the masks' time goes (``duet bench structured``): filling them on the thread, the
        # step waiting for them after its forward, and applying them and advancing the matchers.
        self.fill_seconds = self.wait_seconds = self.apply_seconds = 0.0

    def matcher(self, state: CachedRequestState):
        """The request's matcher, built and fed its output so far the first time it is asked for;
        None without a constraint, or once the constraint failed (``take_failures``)."""
        spec = state.sampling_params.structured_outputs
        if spec is None or state.request_id in self._failures:
            return None
        matcher = self._matchers.get(state.request_id)
        if matcher is None:
            try:
                matcher = self._compiled(spec.grammar_text()).deep_copy()
                self._consume(matcher, state.output_token_ids, state.request_id)
            except GrammarError as error:
                self._failures[state.request_id] = str(error)
                return None
            self._matchers[state.request_id] = matcher
        return matcher

    def _compiled(self, grammar: str):
        """A pristine matcher of the grammar, never advanced: requests start from copies of it.
        A copy takes 0.01 ms where a new matcher takes 0.3-0.7 ms and its first mask up to 1 ms
        more (llguidance builds its lexer lazily, and copies share what the first mask built)."""
        pristine = self._pristine.pop(grammar, None)
        if pristine is None:
            import llguidance

            if self._mask_executor is None:
                self._mask_executor = llguidance.LLExecutor()
            pristine = llguidance.LLMatcher(self.tokenizer(), grammar, log_level=0)
            pristine.compute_bitmask()
            if pristine.is_error():  # the engine checks constraints on arrival: only a limit gets here
                raise GrammarError(f"the constraint does not compile: {first_line(pristine.get_error())}")
            if len(self._pristine) >= COMPILED_GRAMMARS:
                self._pristine.pop(next(iter(self._pristine)))  # the least recently used
        self._pristine[grammar] = pristine
        return pristine

    def tokenizer(self):
        """llguidance's view of the model's tokenizer, the engine's own in the same process
        (``duet.structured_output.grammar_tokenizer``)."""
        return grammar_tokenizer(self.tokenizer_path, self.vocab_size, self.eos_token_id)

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
        self._failures.pop(request_id, None)

    def take_failures(self) -> dict[str, str]:
        """The requests whose constraint could not go on since the last call, and why."""
        failures, self._failures = self._failures, {}
        return failures

    def only_eos_left(self, state: CachedRequestState) -> bool:
        """Whether the constraint is complete, so that EOS is the one token it allows."""
        matcher = self._matchers.get(state.request_id)
        return matcher is not None and matcher.is_stopped() and not matcher.is_error()

    def start(self, rows: list[tuple[CachedRequestState, list[int]]]) -> MaskJob | None:
        """Begin filling the masks of one step's logits rows: per request that samples, in row
        order, its state and the drafts it verifies (one row, plus one per draft). None when no
        request in the step is constrained."""
        entries, covered = [], []
        row = 0
        for state, drafts in rows:
            matcher = self.matcher(state)
            if matcher is not None:
                entries.append((matcher, len(covered), list(drafts)))
                covered.extend(range(row, row + len(drafts) + 1))
            row += len(drafts) + 1
        if not entries:
            return None
        if self._thread is not None:
            return MaskJob(covered, self._thread.submit(self._fill, entries, len(covered)))
        filled = Future()
        filled.set_result(self._fill(entries, len(covered)))
        return MaskJob(covered, filled)

    def _fill(self, entries, num_rows: int) -> torch.Tensor:
        """[num_rows, words] the rows' token bitmasks (``duet.kernels.token_bitmask``). Rows past a
        draft the grammar refuses stay unconstrained: verification rejects that draft, so they
        are never used."""
        import llguidance.numpy

        started = time.perf_counter()
        bitmask = llguidance.numpy.allocate_token_bitmask(num_rows, self.vocab_size)
        plain = [(matcher, row) for matcher, row, drafts in entries if not drafts]
        if plain:
            llguidance.numpy.fill_next_token_bitmask_par(self._mask_executor, plain, bitmask)
        if len(plain) < len(entries):
            with_drafts = [entry for entry in entries if entry[2]]
            llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(self._mask_executor, with_drafts, bitmask)
        self.fill_seconds += time.perf_counter() - started
        return torch.from_numpy(bitmask)

    def apply(self, logits: torch.Tensor, job: MaskJob | None) -> None:
        """Forbidden tokens of the job's rows to -inf, in place, once the masks are filled."""
        if job is None:
            return
        started = time.perf_counter()
        bitmask = job.future.result()
        filled = time.perf_counter()
        rows = torch.tensor(job.rows, device=logits.device)
        apply_token_bitmask(logits, bitmask.to(logits.device, non_blocking=True), rows)
        self.wait_seconds += filled - started
        self.apply_seconds += time.perf_counter() - filled

    def clip_drafts(self, state: CachedRequestState, drafts: list[int]) -> list[int]:
        """The longest prefix of the drafts the constraint allows (no state changes)."""
        matcher = self.matcher(state)
        if matcher is None or not drafts:
            return drafts
        return drafts[: matcher.validate_tokens(drafts)]

    def accept(self, state: CachedRequestState, token_ids: list[int]) -> None:
        """Advance the request's matcher past the tokens it emitted this step."""
        matcher = self._matchers.get(state.request_id)
        if matcher is not None:
            started = time.perf_counter()
            try:
                self._consume(matcher, token_ids, state.request_id)
            except GrammarError as error:
                self._failures[state.request_id] = str(error)
                del self._matchers[state.request_id]
            self.apply_seconds += time.perf_counter() - started

    def _consume(self, matcher, token_ids: list[int], request_id: str) -> None:
        """Feed tokens to a matcher; a complete constraint takes EOS alone, which ends the output.
        A matcher in error also reads as stopped (its mask allows EOS alone): that must not pass
        for a complete output."""
        for index, token_id in enumerate(token_ids):
            if matcher.is_error():
                break
            if matcher.is_stopped():
                if token_ids[index:] != [self.eos_token_id]:
                    raise GrammarError(f"request {request_id} went on past the end of its constraint")
                return
            if not matcher.consume_token(token_id):
                break
        if matcher.is_error():
            raise GrammarError(f"request {request_id}'s constraint cannot go on: {first_line(matcher.get_error())}")

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
