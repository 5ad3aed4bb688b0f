"""The autoscalers' shared board: per application, each pool's latest view (what its policy saw
at its last tick), each pool's latest decision (for ``/metrics`` and ``duet status``) and the
operators' pins (``duet scale``); per deployment of an application, the LoRA adapters its
routers serve (``/v1/load_lora_adapter``), the same on every router replica.

It lives in a named, detached Ray actor (``BOARD_NAME`` in namespace ``duet``), the one place
the pools' policies, the router and the CLI all reach: the policies run in Serve's controller,
the router in its own replicas, ``duet up`` exits once it deployed. ``Board`` is the state and
its rules, plain Python: the actor's body, and the in-memory board of unit tests
(``LocalBoard``).

A policy runs on the controller's event loop every tick and must never wait on the actor:
``ActorBoard.exchange`` sends this tick's view and takes the answer to an earlier one if it
has come, so the other pool's view it decides with is a tick or two old (0.1-0.2 s).
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("ray.serve")

BOARD_NAME = "duet-autoscaler-board"
BOARD_NAMESPACE = "duet"
HEAD_NODE_RESOURCE = "node:__internal_head__"  # every head node has one (Ray's own name)
READ_TIMEOUT_S = 5.0  # a router's or the CLI's read; a policy never waits


class Board:
    """Views, decisions and pins, keyed by application and stage, and the contexts waiting in
    each router replica and its arrivals (plain, picklable data)."""

    def __init__(self) -> None:
        self._views: dict[str, dict] = {}
        self._decisions: dict[str, dict[str, dict]] = {}
        self._pins: dict[str, dict[str, dict]] = {}
        self._waiting: dict[str, dict[str, dict]] = {}
        self._loras: dict[str, dict[str, str]] = {}

    def loras(self, key: str, configured: dict[str, str]) -> dict[str, str]:
        """The adapters a deployment's routers serve, name: folder (``key``: the deployment's;
        ``configured``: those its config names, served until unloaded)."""
        return dict(self._loras.setdefault(key, dict(configured)))

    def set_lora(self, key: str, name: str, path: str | None, configured: dict[str, str]) -> bool:
        """Serve adapter ``name`` from ``path`` (None: serve it no more); False if it was already
        served (a load) or was not (an unload), which changes nothing."""
        loras = self._loras.setdefault(key, dict(configured))
        if (path is None) != (name in loras):
            return False
        if path is None:
            del loras[name]
        else:
            loras[name] = path
        return True

    def post(self, app_name: str, stage: str, view) -> tuple[dict, dict[str, dict], dict[str, dict]]:
        """Post a pool's view; every view of the application, its pins and its routers' waiting
        contexts."""
        self._views.setdefault(app_name, {})[stage] = view
        return dict(self._views[app_name]), dict(self._pins.get(app_name, {})), dict(self._waiting.get(app_name, {}))

    def report_waiting(self, app_name: str, router_id: str, tokens: int, at: float, arrivals: list[dict] | None = None) -> None:
        """A router replica's context tokens waiting for a pool with room, and what it took in
        lately (``duet.router.arrivals``), at ``at`` (wall-clock seconds: a router that stops
        reporting ages out of the policies' sums)."""
        self._waiting.setdefault(app_name, {})[router_id] = {"tokens": tokens, "at": at, "arrivals": arrivals}

    def publish(self, app_name: str, stage: str, record: dict) -> None:
        self._decisions.setdefault(app_name, {})[stage] = record

    def published(self, app_name: str, stages: list[str]) -> dict[str, dict]:
        """The latest decision of each of those stages that has one."""
        decisions = self._decisions.get(app_name, {})
        return {stage: decisions[stage] for stage in stages if stage in decisions}

    def pin(self, app_name: str, stage: str, replicas: int | None, at: float) -> None:
        """Hold a pool at ``replicas`` from ``at`` (wall-clock seconds) on; None unpins it."""
        pins = self._pins.setdefault(app_name, {})
        if replicas is None:
            pins.pop(stage, None)
        else:
            pins[stage] = {"replicas": replicas, "at": at}


class LocalBoard(Board):
    """The board in this process, answering at once (unit tests; ``exchange`` as ``ActorBoard``'s)."""

    def exchange(self, app_name: str, stage: str, view) -> tuple[dict, dict[str, dict], dict[str, dict]]:
        return self.post(app_name, stage, view)


def board_actor():
    """The cluster's board actor, started by whoever asks first, on the head node (as Serve's
    controller is): a node that leaves the cluster takes no pins or adapters with it."""
    import ray

    actor_class = ray.remote(num_cpus=0, max_restarts=-1, resources={HEAD_NODE_RESOURCE: 0.001})(Board)
    return actor_class.options(name=BOARD_NAME, namespace=BOARD_NAMESPACE, lifetime="detached", get_if_exists=True).remote()


class ActorBoard:
    """A policy's (or router's) way to the board actor. ``exchange`` and ``publish`` never wait;
    ``published`` and ``pin`` do, within ``READ_TIMEOUT_S``."""

    def __init__(self) -> None:
        self._actor = None
        self._pending = None  # the answer to an earlier post, until it comes
        self._latest: tuple[dict, dict[str, dict], dict[str, dict]] = ({}, {}, {})

    def _board(self):
        if self._actor is None:
            self._actor = board_actor()
        return self._actor

    def exchange(self, app_name: str, stage: str, view) -> tuple[dict, dict[str, dict], dict[str, dict]]:
        """Post this pool's view; the latest views, pins and waiting contexts the board has
        answered with."""
        import ray

        if self._pending is not None:
            ready, _ = ray.wait([self._pending], timeout=0)
            if ready:
                try:
                    self._latest = ray.get(self._pending)
                except ray.exceptions.RayError as error:  # restarted: the next answer comes from the new one
                    logger.warning("the autoscaler board did not answer: %r", error)
                self._pending = None
        reply = self._board().post.remote(app_name, stage, view)
        if self._pending is None:
            self._pending = reply
        return self._latest

    def publish(self, app_name: str, stage: str, record: dict) -> None:
        self._board().publish.remote(app_name, stage, record)

    def report_waiting(self, app_name: str, router_id: str, tokens: int, arrivals: list[dict] | None = None) -> None:
        self._board().report_waiting.remote(app_name, router_id, tokens, time.time(), arrivals)

    def published(self, app_name: str, stages: list[str]) -> dict[str, dict]:
        import ray

        return ray.get(self._board().published.remote(app_name, list(stages)), timeout=READ_TIMEOUT_S)

    def loras(self, key: str, configured: dict[str, str]) -> dict[str, str]:
        import ray

        return ray.get(self._board().loras.remote(key, configured), timeout=READ_TIMEOUT_S)

    def set_lora(self, key: str, name: str, path: str | None, configured: dict[str, str]) -> bool:
        import ray

        return ray.get(self._board().set_lora.remote(key, name, path, configured), timeout=READ_TIMEOUT_S)

    def pin(self, app_name: str, stage: str, replicas: int | None) -> None:
        import ray

        ray.get(self._board().pin.remote(app_name, stage, replicas, time.time()), timeout=READ_TIMEOUT_S)
