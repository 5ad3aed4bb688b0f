"""Speculative decoding inside the runner: who drafts, how many tokens, and verification."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from duet.config import SpeculativeConfig
from duet.sampler import sampling_probs
from duet.spec_decode.policy import AcceptanceEstimate, StepCostModel, choose_draft_lengths
from duet.spec_decode.rejection import one_hot_draft_probs, rejection_sample

if TYPE_CHECKING:
    from duet.runner_state import CachedRequestState
    from duet.spec_decode.proposers import ModelProposer, NgramProposer

# Acceptance assumed for a request with no verified drafts yet, before any request has any.
_INITIAL_ACCEPTANCE = 0.5
# A request joins a step's probes once this share of its probe interval has passed.
_PROBE_JOIN = 0.5


@dataclass
class _Track:
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    # The distribution each pending draft token was sampled from (random requests of model proposers).
    draft_probs: torch.Tensor | None = None


class SpeculativeDecoder:
    """Proposes draft tokens after a request's step and verifies them at its next one.

    A request drafts when its sampling allows exact verification (no penalties or logprobs, and
    under a constraint no min_tokens still to come),
    at most as many tokens as it may still emit minus one; with ``adaptive`` the policy in
    ``duet.spec_decode.policy`` picks how many, from the measured step cost and the request's
    acceptance. Nobody drafts while ``disable_by_batch_size`` or more requests run.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: NgramProposer | ModelProposer,
        vocab_size: int,
        max_model_len: int,
        eos_token_id: int | None,
    ) -> None:
        self.config = config
        self.eos_token_id = eos_token_id
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.step_cost = StepCostModel()
        # Acceptance over every request's drafts: the prior for a request with few of its own.
        self.overall = AcceptanceEstimate()
        self._tracks: dict[str, _Track] = {}

    def forget(self, request_id: str) -> None:
        self._tracks.pop(request_id, None)
        self.proposer.forget(request_id)

    def num_drafts(self, state: CachedRequestState) -> int:
        """How many tokens the request may draft now (0: it may not)."""
        params = state.sampling_params
        num_output = len(state.output_token_ids)
        if params.logprobs is not None or params.has_penalties:
            return 0
        # Under a constraint, min_tokens gives way to EOS once EOS is all the constraint allows;
        # the runner's plain sampling path knows that, verification does not.
        if params.structured_outputs is not None and num_output < params.min_tokens:
            return 0
        room = min(params.max_tokens - num_output, self.max_model_len - state.num_tokens) - 1
        return max(0, min(self.config.num_speculative_tokens, room))

    def propose(self, states: list[CachedRequestState], num_running: int) -> dict[str, list[int]]:
        """Drafts for the requests that just sampled, keyed by request id; absent: no draft."""
        limit = self.config.disable_by_batch_size
        if limit is not None and num_running >= limit:
            return {}
        allowed = [(state, self.num_drafts(state)) for state in states]
        candidates = [state for state, k in allowed if k]
        max_lengths = [k for _, k in allowed if k]
        tracks = [self._tracks.setdefault(state.request_id, _Track()) for state in candidates]
        lengths = max_lengths
        if self.config.adaptive:
            lengths = self._adaptive_lengths(tracks, max_lengths, num_running)
        chosen = [(state, length) for state, length in zip(candidates, lengths) if length]
        if not chosen:
            return {}
        drafts, probs = self.proposer.propose([state for state, _ in chosen], [length for _, length in chosen])
        proposals = {}
        for (state, _), tokens, rows in zip(chosen, drafts, probs):
            self._tracks[state.request_id].draft_probs = rows
            if tokens:
                proposals[state.request_id] = tokens
        return proposals

    def _adaptive_lengths(self, tracks: list[_Track], max_lengths: list[int], num_running: int) -> list[int]:
        prior = self.overall.alpha(_INITIAL_ACCEPTANCE)
        alphas = [track.acceptance.alpha(prior) for track in tracks]
        draft_cost = self.proposer.seconds_per_forward / max(1, len(tracks))
        lengths = choose_draft_lengths(alphas, max_lengths, num_running, self.step_cost.fit(), draft_cost)
        for track, length in zip(tracks, lengths):
            track.acceptance.count_step(drafting=length > 0)
        # Requests without drafts probe (one draft) when due; once one does, those due within
        # half their interval join it, so that probes share the steps that pay for verification.
        idle = [index for index, length in enumerate(lengths) if not length]
        if any(tracks[index].acceptance.probe_due() for index in idle):
            for index in idle:
                if tracks[index].acceptance.probe_due(within=_PROBE_JOIN):
                    tracks[index].acceptance.start_probe()
                    lengths[index] = 1
        return lengths

    def verify(self, logits: torch.Tensor, states: list[CachedRequestState], drafts: list[list[int]]) -> list[list[int]]:
        """``logits`` holds k_r + 1 consecutive rows per request (its last verified token, then each
        draft); returns the tokens each request emits: its accepted drafts and one more."""
        greedy = [state.sampling_params.greedy for state in states]
        self._forbid_early_stops(logits, states, drafts)
        target = logits
        draft_probs = None
        if not all(greedy):
            target, draft_probs = self._random_rows(logits, states, drafts)
        result = rejection_sample(drafts, draft_probs, target, greedy, [state.generator for state in states])
        for state, tokens, num_accepted in zip(states, drafts, result.num_accepted_tokens):
            track = self._tracks.setdefault(state.request_id, _Track())
            track.acceptance.observe(len(tokens), num_accepted)
            self.overall.observe(len(tokens), num_accepted)
            track.draft_probs = None
        return [self._cut_after_stop(state, tokens) for state, tokens in zip(states, result.sampled_token_ids)]

    def _cut_after_stop(self, state: CachedRequestState, tokens: list[int]) -> list[int]:
        """The tokens up to the first that ends the request (EOS, a stop token id): a kept draft
        may be one, and the target's token after it is no output (under a constraint, a token
        past the end the grammar refuses). Before min_tokens they cannot be there
        (``_forbid_early_stops``)."""
        params = state.sampling_params
        stops = set(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            stops.add(self.eos_token_id)
        for index, token_id in enumerate(tokens[:-1]):
            if token_id in stops:
                return tokens[: index + 1]
        return tokens

    def _forbid_early_stops(self, logits: torch.Tensor, states: list[CachedRequestState], drafts: list[list[int]]) -> None:
        """Before min_tokens, EOS and stop token ids are impossible at that position (in place)."""
        row = 0
        for state, tokens in zip(states, drafts):
            params = state.sampling_params
            num_early = min(len(tokens) + 1, params.min_tokens - len(state.output_token_ids))
            if num_early > 0:
                forbidden = [*params.stop_token_ids, *([] if self.eos_token_id is None else [self.eos_token_id])]
                forbidden = [token_id for token_id in forbidden if token_id < self.vocab_size]
                logits[row : row + num_early, forbidden] = float("-inf")
            row += len(tokens) + 1

    def _random_rows(
        self, logits: torch.Tensor, states: list[CachedRequestState], drafts: list[list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Target and draft distributions for random requests; greedy requests keep raw logits
        (only their argmax is read) and zero draft rows."""
        target = logits.clone()
        draft_rows = []
        row = 0
        for state, tokens in zip(states, drafts):
            num_rows = len(tokens) + 1
            params = state.sampling_params
            if params.greedy:
                draft_rows.append(torch.zeros(len(tokens), self.vocab_size, device=logits.device))
            else:
                target[row : row + num_rows] = sampling_probs(logits[row : row + num_rows], [params] * num_rows)
                stored = self._tracks[state.request_id].draft_probs
                if stored is None:
                    draft_rows.append(one_hot_draft_probs([tokens], self.vocab_size, logits.device))
                else:
                    draft_rows.append(stored[: len(tokens)])
            row += num_rows
        return target, torch.cat(draft_rows)

