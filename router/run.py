"""One HTTP request's sequences (``n`` completions of each of its prompts) run through the
``Orchestrator`` at once, their token ids made into text here, and their deltas merged in the
order they come; the request's metrics (TTFT, ITL, end-to-end, tokens) observed on the way."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from contextlib import aclosing

from duet.detokenizer import SequenceText
from duet.router.metrics import RouterMetrics
from duet.router.pd import Orchestrator
from duet.router.responses import Choice, ResponseBuilder
from duet.router.serve_internals import new_call_context
from duet.router.tokenizer import RouterTokenizer
from duet.sampling_params import SamplingParams


@dataclasses.dataclass
class SequenceSpec:
    """One sequence of a request: which completion (``n`` fan-out and prompt lists) and how to sample it."""

    choice_index: int
    prompt_index: int
    params: SamplingParams


class Run:
    """One HTTP request's sequences running concurrently, merged in arrival order."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        tokenizer: RouterTokenizer,
        metrics: RouterMetrics,
        request_id: str,
        encoded: list[list[int]],
        sequences: list[SequenceSpec],
        arrival: float,
        skipped_ids: frozenset[int] | None = None,
        lora: tuple[str, str] | None = None,
    ) -> None:
        """``skipped_ids``: the special tokens the outputs' text leaves out, where not all;
        ``lora``: the LoRA adapter every sequence runs with, its name and folder (None: the base model)."""
        self.orchestrator = orchestrator
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.request_id = request_id
        self.encoded = encoded
        self.sequences = sequences
        self.arrival = arrival
        self.skipped_ids = skipped_ids
        self.lora = lora
        self.choices = [Choice(sequence.choice_index) for sequence in sequences]
        self.num_cached_tokens = 0

    def usage(self, builder: ResponseBuilder) -> dict:
        return builder.usage(sum(len(prompt) for prompt in self.encoded), self.choices, self.num_cached_tokens)

    async def deltas(self):
        """Yields ``(choice index, TextDelta)`` as any sequence produces output."""
        merged: asyncio.Queue = asyncio.Queue()
        metrics = self.metrics
        tasks = [asyncio.create_task(self._pump(sequence, merged)) for sequence in self.sequences]
        first_token_at = None
        try:
            for _ in range(len(tasks)):
                while (item := await merged.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    index, delta = item
                    if first_token_at is None:
                        first_token_at = time.monotonic()
                        metrics.ttft.observe(first_token_at - self.arrival)
                    self.choices[index].add(delta)
                    yield index, delta
            metrics.e2e.observe(time.monotonic() - self.arrival)
            prompt_tokens, generated = sum(len(prompt) for prompt in self.encoded), sum(len(choice.token_ids) for choice in self.choices)
            metrics.prompt_tokens.inc(prompt_tokens)
            metrics.generation_tokens.inc(generated)
            for choice in self.choices:
                metrics.success.labels(metrics.model_name, choice.finish_reason or "abort").inc()
            if self.lora is not None:
                labels = (metrics.model_name, self.lora[0])
                metrics.lora_requests.labels(*labels).inc()
                metrics.lora_prompt_tokens.labels(*labels).inc(prompt_tokens)
                metrics.lora_generation_tokens.labels(*labels).inc(generated)
        finally:
            for task in tasks:
                task.cancel()

    async def _pump(self, sequence: SequenceSpec, merged: asyncio.Queue) -> None:
        """One sequence's token ids from the pools, made into text here; a stop string ends it
        (leaving the ``async with`` aborts it in the pools, which know no text)."""
        new_call_context()
        prompt = self.encoded[sequence.prompt_index]
        sequence_id = f"{self.request_id}-{sequence.choice_index}"
        text = SequenceText.start(self.tokenizer.backend, sequence.params, self.skipped_ids)
        last = None
        try:
            async with aclosing(self.orchestrator.run(sequence_id, prompt, sequence.params, self.lora)) as deltas:
                async for delta in deltas:
                    now = time.monotonic()
                    if last is not None and delta.token_ids:
                        for _ in delta.token_ids:
                            self.metrics.itl.observe((now - last) / len(delta.token_ids))
                    last = now
                    if delta.num_cached_tokens and sequence.choice_index == 0:
                        self.num_cached_tokens = delta.num_cached_tokens
                    merged.put_nowait((sequence.choice_index, text.add(delta)))
                    if text.finished:
                        break
            merged.put_nowait(None)
        except Exception as error:  # noqa: BLE001 - handed to the consumer
            merged.put_nowait(error)
