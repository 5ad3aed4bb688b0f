"""Draft proposers: n-gram lookup, and a model (a separate draft, or the target's first layers)
run autoregressively over the paged KV cache."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from duet.model_inputs import Span, build_batch
from duet.sampler import copy_generator, exponential_race, sampling_probs
from duet.spec_decode.ngram import propose_ngram_tokens

if TYPE_CHECKING:
    from duet.runner_state import CachedRequestState


class NgramProposer:
    """Copies what followed an earlier occurrence of the context's tail; draft "probabilities" are one-hot."""

    # Lookups cost microseconds: no time worth weighing against the target's.
    seconds_per_forward = 0.0

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def propose(
        self, states: list[CachedRequestState], num_drafts: list[int]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        drafts = [
            propose_ngram_tokens(state.token_ids, self.prompt_lookup_min, self.prompt_lookup_max, k)
            for state, k in zip(states, num_drafts)
        ]
        return drafts, [None] * len(drafts)

    def forget(self, request_id: str) -> None:
        pass


class ModelProposer:
    """Drafts k tokens with a causal LM over KV blocks indexed by the target's block ids.

    ``draft_model``: a separate model with a KV cache of its own, the same number of blocks.
    Its KV is computed here, lazily: each proposal first feeds the draft every token it has not
    seen (the whole prompt the first time, whether the target computed it here, took it from the
    prefix cache or received it from a prefill replica; then the tokens the last step emitted).
    ``layer_skip``: the target's first layers and their KV cache; the target's own forward
    already wrote that KV for every verified token, so only the newest token is fed.
    Draft tokens write KV past the verified ones, into the slots the scheduler reserved ahead.
    A seeded random request's drafts are drawn with the races its own generator will draw for
    those positions (from a copy of it, left untouched): verification samples each position with
    those same races, so a draft as likely under the draft as under the target agrees with it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: str,
        shares_target_cache: bool,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.shares_target_cache = shares_target_cache
        # Tokens whose draft KV is in the cache, per request (own cache only).
        self.num_computed: dict[str, int] = {}
        # Running mean of one drafting forward's time (the policy weighs it against the gain).
        self.seconds_per_forward = 0.0

    def forget(self, request_id: str) -> None:
        self.num_computed.pop(request_id, None)

    def propose(
        self, states: list[CachedRequestState], num_drafts: list[int]
    ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per request, ``num_drafts`` tokens and (for random requests) the [k, vocab] distribution
        each was sampled from."""
        # Each seeded random request's next races, one per draft position, in order.
        generators = {
            index: copy_generator(state.generator)
            for index, state in enumerate(states)
            if state.generator is not None and not state.sampling_params.greedy
        }
        spans = []
        for state in states:
            start = self._first_unseen(state)
            spans.append(Span(state.token_slice(start, state.num_tokens), start, state.block_ids, state.prompt_len))
            if not self.shares_target_cache:
                self.num_computed[state.request_id] = state.num_tokens
        tokens, probs = self._draft_step(spans, states, generators)
        drafts = [[token] for token in tokens]
        draft_probs: list[list[torch.Tensor]] = [[row] if row is not None else [] for row in probs]
        active = list(range(len(states)))
        for step in range(1, max(num_drafts)):
            active = [i for i in active if num_drafts[i] > step]
            spans = [Span([drafts[i][-1]], states[i].num_tokens + step - 1, states[i].block_ids, states[i].prompt_len) for i in active]
            step_generators = {row: generators[i] for row, i in enumerate(active) if i in generators}
            tokens, probs = self._draft_step(spans, [states[i] for i in active], step_generators)
            for i, token, row in zip(active, tokens, probs):
                drafts[i].append(token)
                if row is not None:
                    draft_probs[i].append(row)
        return drafts, [torch.stack(rows) if rows else None for rows in draft_probs]

    def _first_unseen(self, state: CachedRequestState) -> int:
        if self.shares_target_cache:
            return state.num_tokens - 1
        return min(self.num_computed.get(state.request_id, 0), state.num_tokens - 1)

    def _draft_step(
        self, spans: list[Span], states: list[CachedRequestState], generators: dict[int, torch.Generator]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One forward over the spans; the next token of each, sampled as its request samples
        (``generators``: the streams of the seeded ones, by index in ``states``)."""
        started = time.perf_counter()
        batch = build_batch(spans, self.block_size, self.device)
        last_rows = torch.tensor([end - 1 for end in batch.span_ends], device=self.device)
        logits = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata, last_rows)
        tokens = logits.argmax(dim=-1)
        probs: list[torch.Tensor | None] = [None] * len(states)
        random_rows = [row for row, state in enumerate(states) if not state.sampling_params.greedy]
        if random_rows:
            row_probs = sampling_probs(logits[random_rows], [states[row].sampling_params for row in random_rows])
            row_generators = {index: generators[row] for index, row in enumerate(random_rows) if row in generators}
            # The race divides its input in place: keep the distribution for verification.
            sampled = exponential_race(row_probs.clone(), row_generators)
            tokens[random_rows] = sampled
            for index, row in enumerate(random_rows):
                probs[row] = row_probs[index]
        token_ids = tokens.tolist()
        self.seconds_per_forward += 0.2 * (time.perf_counter() - started - self.seconds_per_forward)
        return token_ids, probs
