"""Every use duet makes of a Ray or Serve internal, and the process-wide state Serve makes us
keep, behind four small interfaces:

- **call context** (``new_call_context``): Serve's request router matches a routed call to its
  caller by the request id of the task that made it; two calls in flight under one id are never
  matched. Serve sets that id per HTTP request and has no public way to give a task its own, so
  this sets it through ``ray.serve.context._set_request_context``.
- **pool view** (``pool_stats``, ``pool_members``, ``pool_size``, ``live_replicas``, ``replica_ids``,
  ``replica_running``): the replicas of each pool and their reported stats, as the request
  router of that pool in this process sees them. Serve ships request routers, ingress classes
  and replicas by value, so each copy's functions get globals of their own: the routers are
  registered here and found through ``sys.modules`` (``_shared``), the one table all copies share.
- **departure notice** (``watch_departure``): an event set when a replica leaves its pool's set
  (Serve stopping it, or its death), as that pool's router in this process sees it.
- **loopback** (``keep_replica_on_loopback``): Ray 2.60's Serve replica starts a gRPC server on
  ``[::]:0``, hard-coded in ``ray/serve/_private/replica.py``; on a local cluster it is rebound to
  127.0.0.1.

``INTERNALS`` names each private name used here; ``tests/router/test_serve_internals.py`` fails,
naming it, when the installed Ray moves one, and ``pyproject.toml`` pins Ray to the versions
this module was tested with.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
import uuid

from typing import TYPE_CHECKING

from duet.messages import ReplicaStats

if TYPE_CHECKING:  # importing ray here would come before `duet up` sets the loopback variable
    from ray.serve.request_router import RequestRouter

logger = logging.getLogger(__name__)

TESTED_RAY_VERSIONS = ("2.60",)
# The private names this module relies on: (module, attribute).
INTERNALS = (
    ("ray.serve.context", "_set_request_context"),
    ("ray.serve._private.replica", "add_port_to_grpc_server"),
)

# A pool whose every replica has been silent this long is down (the ingress refuses with 503).
# Far above the 3 s after which ``duet status`` calls a report stale: stats come through Serve's
# controller, which a loaded machine holds up for seconds, and Serve replaces a stopped replica
# after its health check's 30 s.
POOL_DOWN_S = 30.0
LOOPBACK_RAY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node address is 127.0.0.1

# Pool name ("prefill", "decode", "colocated") -> the request router of that pool in this process.
_ROUTERS: dict[str, RequestRouter] = {}
# Replica id -> events to set (each on its own event loop) when the replica leaves its pool's set.
_DEPARTURE_WATCHERS: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]] = {}
# Replica -> (its last report as Serve's router holds it, that report parsed): a report is
# read several times a request (routing, balancing, roles) and replaced whole when a new one comes.
_PARSED: dict[int, tuple[dict, ReplicaStats]] = {}  # by the id of Serve's replica object
_PARSED_LIMIT = 64  # replicas remembered (past it, all are forgotten: each report holds its prefix hashes)


def _shared():
    """This module as imported (``sys.modules``), whichever by-value copy of a caller asks."""
    return importlib.import_module(__name__)


# -- call context


def new_call_context() -> None:
    """Give the current task a Serve request id of its own; call it before each call to a pool
    that may overlap another (the id is shared with every call made while handling one HTTP
    request, and with the tasks it starts)."""
    from ray.serve.context import _set_request_context

    _set_request_context(_internal_request_id=uuid.uuid4().hex)


# -- pool view


def register_router(pool: str, router: RequestRouter) -> None:
    _shared()._ROUTERS[pool] = router


def _router(pool: str) -> RequestRouter | None:
    return _shared()._ROUTERS.get(pool)


def _running(pool: str) -> list | None:
    """The running replicas of a pool as this process's router lists them, copied in one step
    (None: no router yet). Serve's router updates its dict on its own event loop's thread (it
    drops a dead replica in place); a loop over the dict itself, reading each replica's report
    between steps, once met it changing size mid-loop and failed a prompt that was falling back
    from a killed prefill replica."""
    router = _router(pool)
    return None if router is None else list(router.curr_replicas.values())


def reported_stats(replica) -> ReplicaStats | None:
    """A replica's last ``record_routing_stats`` report; None before its first. Parsed once a
    report (``ReplicaStats`` is frozen: the parse is shared)."""
    report = replica.routing_stats
    if not report:
        return None
    parsed = _shared()._PARSED
    key = id(replica)  # its report, checked by identity below, cannot be another's
    cached = parsed.get(key)
    if cached is not None and cached[0] is report:
        return cached[1]
    if len(parsed) >= _PARSED_LIMIT:
        parsed.clear()
    stats = ReplicaStats.from_dict(report)
    parsed[key] = (report, stats)
    return stats


def pool_stats(pool: str) -> list[ReplicaStats] | None:
    """The last stats of each running replica of a pool; None before the pool was first called."""
    replicas = _running(pool)
    if replicas is None:
        return None
    return [stats for stats in map(reported_stats, replicas) if stats is not None]


def pool_members(pool: str) -> list[tuple[str, ReplicaStats | None]]:
    """Each running replica of a pool, as this process's router sees it: its id and its last
    report (None before its first)."""
    return [(replica.replica_id.unique_id, reported_stats(replica)) for replica in _running(pool) or ()]


def pool_size(pool: str) -> int | None:
    """Running replicas of a pool as this process's router sees them; None if not known yet."""
    replicas = _running(pool)
    return None if replicas is None else len(replicas)


def live_replicas(pool: str) -> int | None:
    """Running replicas of a pool that are not down: reported stats in the last ``POOL_DOWN_S``
    seconds (their clocks and ours agree to well within that), or have not reported yet (just
    started); None while this process's router of the pool lists none (before its first call,
    or between Serve's updates: calls then wait in Serve's queue)."""
    replicas = _running(pool)
    if not replicas:
        return None
    now = time.time()
    stats = [reported_stats(replica) for replica in replicas]
    return sum(1 for replica in stats if replica is None or now - replica.reported_at < POOL_DOWN_S)


def replica_ids(pool: str) -> list[str]:
    """The running replicas of a pool as this process's router sees them (none before its first call)."""
    return [replica.replica_id.unique_id for replica in _running(pool) or ()]


def replica_running(pool: str, replica_id: str) -> bool:
    """Whether this process's router of ``pool`` still lists the replica (True before it has a router)."""
    replicas = _running(pool)
    return replicas is None or any(replica.replica_id.unique_id == replica_id for replica in replicas)


# -- departure notice


def watch_departure(replica_id: str) -> asyncio.Event:
    """An event set (on the caller's loop) once a router in this process sees the replica leave
    its pool's set: Serve stopping it (scale-down, redeploy) or its death."""
    event = asyncio.Event()
    _shared()._DEPARTURE_WATCHERS.setdefault(replica_id, []).append((asyncio.get_running_loop(), event))
    return event


def departed(replica_ids) -> None:
    """What a pool's router calls when replicas leave its set."""
    for replica_id in replica_ids:
        for loop, event in _shared()._DEPARTURE_WATCHERS.pop(replica_id, []):
            loop.call_soon_threadsafe(event.set)


# -- loopback


def keep_replica_on_loopback() -> None:
    """Call first in a deployment's constructor (Serve constructs the user class before it starts
    the replica's gRPC server): on a loopback cluster (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``,
    see ``duet.cluster.deploy``) the server binds 127.0.0.1. Anywhere else it does nothing."""
    if os.environ.get(LOOPBACK_RAY_ENV) != "0":
        return
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "loopback_only", False):
        if bind is None:
            logger.warning("this Ray's Serve replica has no add_port_to_grpc_server: its gRPC port may listen beyond loopback")
        return

    def loopback_only(server, address: str):
        return bind(server, address.replace("[::]", "127.0.0.1", 1))

    loopback_only.loopback_only = True
    replica.add_port_to_grpc_server = loopback_only


def missing_internals() -> list[str]:
    """The internals in ``INTERNALS`` the installed Ray lacks (``module.attribute``)."""
    missing = []
    for module, attribute in INTERNALS:
        try:
            found = hasattr(importlib.import_module(module), attribute)
        except ImportError:
            found = False
        if not found:
            missing.append(f"{module}.{attribute}")
    return missing


def ray_version_tested() -> bool:
    import ray

    return any(ray.__version__ == version or ray.__version__.startswith(version + ".") for version in TESTED_RAY_VERSIONS)

