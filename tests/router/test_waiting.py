"""The router's waiting room: contexts wait there for a pool with room, holding no KV, and go
as the balancer admits them."""

from __future__ import annotations

import asyncio

import pytest

import duet.router.waiting as waiting
from duet.errors import PoolUnavailableError
from duet.router.balance import Choice


class _ScriptedBalancer:
    """Has room for ``room`` contexts (each through the prefill pool), given in the order asked,
    and says wait past it."""

    def __init__(self) -> None:
        self.room = 0
        self.admitted: list[int] = []
        self.released: list[int] = []

    def admit(self, contexts: list[tuple[int, float, list[int]]]) -> list[Choice | None]:
        choices = []
        for num_tokens, _, _ in contexts:
            choices.append(Choice(False, num_tokens, self) if self.room > 0 else None)
            if self.room > 0:
                self.room -= 1
                self.admitted.append(num_tokens)
        return choices

    def _done(self, choice: Choice, first_token: bool) -> None:
        assert not first_token
        self.released.append(choice.num_tokens)


def test_waiting_contexts_are_placed_as_the_balancer_admits_them_and_not_forever(monkeypatch):
    """One waiting context asks for all; each takes its choice as soon as it is admitted. A
    wait is bounded, and nothing is left queued after it."""
    monkeypatch.setattr(waiting, "WAIT_POLL_S", 0.01)
    balancer = _ScriptedBalancer()
    room = waiting.WaitingRoom(balancer)

    async def scenario():
        tasks = [asyncio.create_task(room.choose(num_tokens)) for num_tokens in (1, 2, 3)]
        await asyncio.sleep(0.05)
        assert not balancer.admitted and room.demand() == 6  # what the autoscalers are told waits
        balancer.room = 1
        await asyncio.sleep(0.05)
        assert balancer.admitted == [1] and tasks[0].done() and room.demand() == 5
        balancer.room = 2
        return await asyncio.gather(*tasks)

    choices = asyncio.run(scenario())
    assert [choice.num_tokens for choice in choices] == [1, 2, 3]
    assert balancer.admitted == [1, 2, 3] and room.contexts_waited == 3
    monkeypatch.setattr(waiting, "ROOM_WAIT_S", 0.05)
    with pytest.raises(PoolUnavailableError):
        asyncio.run(room.choose(4))
    assert not room._waiting and room.contexts_waited == 4 and not balancer.released


def test_a_context_admitted_after_its_client_left_gives_its_room_back():
    balancer = _ScriptedBalancer()
    room = waiting.WaitingRoom(balancer)

    async def scenario():
        task = asyncio.create_task(room.choose(5))
        await asyncio.sleep(0.01)
        balancer.room = 1
        room.admit()  # another waiting context asked for it
        task.cancel()  # before it woke to take the choice
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert balancer.admitted == [5] and balancer.released == [5] and not room._waiting
