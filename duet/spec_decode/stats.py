"""Counters of proposed and accepted draft tokens, as vLLM reports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from duet.messages import SpecStats


@dataclass
class SpecDecodingStats:
    """Totals since the engine started. A "draft" is one request's proposal verified in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i]: drafts whose token at position i was accepted (so every earlier one was too).
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    def stats(self) -> SpecStats:
        return SpecStats(
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            accepted_per_position=list(self.accepted_per_position),
        )
