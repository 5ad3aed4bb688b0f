"""The one module that touches Ray's and Serve's internals: what it relies on is there in the
installed Ray, and its pool view and departure notices behave, against an in-memory pool."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest

from duet.router import serve_internals
from tests.router.fake_serve import FakePool, ReplicaID


@pytest.fixture
def decode_pool(monkeypatch):
    pool = FakePool("decode")
    monkeypatch.setitem(serve_internals._ROUTERS, "decode", pool)
    return pool


def test_every_internal_relied_on_is_in_the_installed_ray():
    """Fails, naming it, when a Ray upgrade moves or renames a private name duet uses."""
    assert serve_internals.missing_internals() == []
    from ray.serve.context import _set_request_context

    assert "_internal_request_id" in inspect.signature(_set_request_context).parameters


def test_the_installed_ray_is_a_version_this_module_was_tested_with():
    import ray

    assert serve_internals.ray_version_tested(), (
        f"Ray {ray.__version__} is not among {serve_internals.TESTED_RAY_VERSIONS}: check duet.router.serve_internals against it, "
        "then add it there and to pyproject.toml's pin"
    )


def test_a_pool_is_down_only_once_every_replica_has_been_silent_for_pool_down_s(decode_pool):
    """Guards against refusing a healthy pool: replicas' reports reach the ingress through
    Serve's controller, which a loaded CI machine can hold up past ``REPLICA_SILENT_S`` (3 s);
    the ingress then took the decode pool for dead (the likely cause of a CI run's failed
    dead-worker stream). Silent for 10 s is stale (``duet status`` says so), not down."""
    now = time.time()
    assert serve_internals.live_replicas("decode") is None  # none listed: calls wait in Serve's queue
    decode_pool.set("a", reported_at=now - 10)
    decode_pool.set("b", reported_at=now - 12)
    assert serve_internals.live_replicas("decode") == 2
    decode_pool.set("a", reported_at=now - serve_internals.POOL_DOWN_S - 1)
    assert serve_internals.live_replicas("decode") == 1
    decode_pool.set("b", reported_at=now - serve_internals.POOL_DOWN_S - 5)
    assert serve_internals.live_replicas("decode") == 0
    decode_pool.set("c", reported=False)  # just started: not down
    assert serve_internals.live_replicas("decode") == 1


def test_the_pool_view_reads_each_replicas_last_report(decode_pool):
    assert serve_internals.pool_stats("prefill") is None and serve_internals.replica_running("prefill", "x")
    decode_pool.set("a", num_free_blocks=7)
    decode_pool.set("b", reported=False)
    assert [(stats.replica_id, stats.kv.num_free_blocks) for stats in serve_internals.pool_stats("decode")] == [("a", 7)]
    assert (serve_internals.pool_size("decode"), serve_internals.replica_ids("decode")) == (2, ["a", "b"])
    assert serve_internals.replica_running("decode", "b") and not serve_internals.replica_running("decode", "gone")


def test_a_report_is_parsed_once_and_a_new_one_is_read_anew(decode_pool):
    """The router reads each replica's report several times a request: one parse a report,
    never a parse kept past the report it came from."""
    decode_pool.set("a", num_free_blocks=7)
    replica = decode_pool.curr_replicas[ReplicaID("a")]
    first = serve_internals.reported_stats(replica)
    assert serve_internals.reported_stats(replica) is first and first.kv.num_free_blocks == 7
    replica.routing_stats = replica.routing_stats | {"kv": replica.routing_stats["kv"] | {"num_free_blocks": 5}}  # a new report
    second = serve_internals.reported_stats(replica)
    assert second is not first and second.kv.num_free_blocks == 5


def test_a_replica_leaving_its_pool_sets_the_events_watching_it(decode_pool):
    async def run():
        decode_pool.set("leaving")
        decode_pool.set("staying")
        leaving, staying = serve_internals.watch_departure("leaving"), serve_internals.watch_departure("staying")
        decode_pool.remove("leaving")
        await asyncio.wait_for(leaving.wait(), 1)
        await asyncio.sleep(0)
        return staying.is_set()

    assert asyncio.run(run()) is False
    serve_internals._DEPARTURE_WATCHERS.pop("staying", None)


def test_the_pool_view_reads_a_copy_of_the_routers_replicas(decode_pool):
    """Serve's router drops a dead replica from its dict on its own thread, which may run while
    the pool view reads one replica's report after another: the view reads a copy (a loop over
    the dict itself failed a prompt falling back from a killed prefill replica in CI)."""
    decode_pool.set("a", num_free_blocks=3)
    decode_pool.set("b", num_free_blocks=4)
    decode_pool.set("c", num_free_blocks=5)

    class Dying(type(decode_pool.curr_replicas[next(iter(decode_pool.curr_replicas))])):
        """A replica whose report, read, lets Serve's thread drop replica "c" (as a switch of
        threads between two reads can)."""

        @property
        def routing_stats(self):
            decode_pool.curr_replicas.pop(ReplicaID("c"), None)
            return self.__dict__["stats"]

    first = next(iter(decode_pool.curr_replicas))
    dying = Dying(replica_id=first)
    dying.__dict__["stats"] = decode_pool.curr_replicas[first].routing_stats
    decode_pool.curr_replicas[first] = dying
    assert [replica_id for replica_id, _ in serve_internals.pool_members("decode")] == ["a", "b", "c"]
    assert [stats.replica_id for stats in serve_internals.pool_stats("decode")] == ["a", "b"]
