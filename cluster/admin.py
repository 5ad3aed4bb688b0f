"""The operators' endpoints beside the client API, and the router's Serve deployment class.

``/duet/status``, ``/duet/scale`` and ``/duet/integrity``, and vLLM's ``/v1/load_lora_adapter``
and ``/v1/unload_lora_adapter``, take their own key: a client key (``router.api_key``) never
pins a pool's size nor changes what the cluster serves. The rule:

- ``admin_api_key`` set: every admin call must bear it;
- no ``admin_api_key`` and no client keys: open, as the client API is (a local cluster);
- client keys but no ``admin_api_key``: refused (403), naming the setting to add.

A LoRA adapter loaded here is checked on a replica of each pool first (a 400 says why it does
not fit, and nothing served changes), then listed on the board (``duet.cluster.board``), which
every router replica reads each ``LORA_REFRESH_S``. Replicas load an adapter when a request
first names it; one unloaded stays in their memory until evicted, named by no new request.

``DuetIngress`` is ``RouterIngress`` (``duet.router.ingress``, the client API) plus these
routes, and the class ``duet.cluster.app`` deploys.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve

from duet.cluster.board import ActorBoard
from duet.router.errors import ApiError, api_error_from, bad_request
from duet.router.ingress import RouterIngress, app, bearer_matches
from duet.router.serve_internals import keep_replica_on_loopback, live_replicas, new_call_context, pool_size, pool_stats, replica_ids

logger = logging.getLogger(__name__)
admin = APIRouter(prefix="/duet")
WAITING_REPORT_S = 1.0  # how often a router reports its waiting contexts and arrivals to the pools' policies
LORA_REFRESH_S = 1.0  # how often a router reads the LoRA adapters served (loaded or unloaded through another router replica)
LORA_CHECK_TIMEOUT_S = 60.0  # a replica's check of an adapter to load (it reads the adapter's weights)


def admin_refusal(request: Request, admin_keys: list[bytes], has_client_keys: bool) -> ApiError | None:
    """Why an admin call is refused (None: it is not), by the rule above."""
    if admin_keys:
        if bearer_matches(request, admin_keys):
            return None
        return ApiError(401, "missing or wrong admin key; send 'Authorization: Bearer <router.admin_api_key>'", "authentication_error")
    if has_client_keys:
        return ApiError(
            403, "this server has client API keys but no admin key: set router.admin_api_key (or DUET_ADMIN_API_KEY) "
            "to use the /duet/ endpoints", "permission_error",
        )
    return None


class DuetIngress(RouterIngress):
    """The router: the client API and the admin routes. ``autoscaled``: each autoscaled pool's
    ``(min_replicas, max_replicas)``; ``lora_registry``: this deployment's key for its adapters on the board."""

    def __init__(self, *args, autoscaled: dict[str, tuple[int, int]], admin_api_key: str | None, lora_registry: str, **kwargs) -> None:
        keep_replica_on_loopback()  # before Serve starts this replica's gRPC server
        super().__init__(*args, **kwargs)
        self.autoscaled = {pool: tuple(bounds) for pool, bounds in autoscaled.items()}
        self.admin_keys = [] if admin_api_key is None else [admin_api_key.encode()]
        self.board = ActorBoard()
        self.lora_registry = lora_registry
        self._lora_lock = threading.Lock()
        self._lora_edits = 0  # loads and unloads made here: a read of the board begun before one is stale
        threading.Thread(target=self._refresh_loras, name="lora-refresh", daemon=True).start()
        if self.autoscaled:
            router_id = serve.get_replica_context().replica_id.unique_id
            threading.Thread(target=self._report_demand, args=(router_id,), name="demand-report", daemon=True).start()

    def _report_demand(self, router_id: str) -> None:
        """Tell the autoscalers, every ``WAITING_REPORT_S``, the context tokens waiting here and
        what this router took in lately (the board's records age out if this replica stops)."""
        waiting_room = self.orchestrator.waiting_room
        while True:
            time.sleep(WAITING_REPORT_S)
            tokens = waiting_room.demand() if waiting_room is not None else 0
            try:
                self.board.report_waiting(self.app_name, router_id, tokens, self.orchestrator.arrivals.summary())
            except Exception as error:  # noqa: BLE001 - the next report may reach it
                logger.warning("could not report the router's demand to the autoscaler board: %r", error)

    def _refresh_loras(self) -> None:
        """Serve the adapters the board lists, every ``LORA_REFRESH_S``."""
        while True:
            try:
                edits = self._lora_edits
                loras = self.board.loras(self.lora_registry, self.lora_modules)
                with self._lora_lock:
                    if edits == self._lora_edits:
                        self.loras = loras
            except Exception as error:  # noqa: BLE001 - served as before; the next read may reach it
                logger.warning("could not read the LoRA adapters served from the board: %r", error)
            time.sleep(LORA_REFRESH_S)

    def _set_loras(self, loras: dict[str, str]) -> None:
        with self._lora_lock:
            self._lora_edits += 1
            self.loras = loras

    def _autoscaler(self) -> dict[str, dict]:
        """The latest decision of each autoscaled pool's policy (none while the board is out of reach)."""
        if not self.autoscaled:
            return {}
        try:
            return self.board.published(self.app_name, list(self.autoscaled))
        except Exception as error:  # noqa: BLE001 - a report without the decisions beats no report
            logger.warning("the autoscaler board did not answer: %r", error)
            return {}

    def _authorize_admin(self, request: Request) -> None:
        refusal = admin_refusal(request, self.admin_keys, bool(self.api_keys))
        if refusal is not None:
            raise refusal

    @admin.get("/status")
    async def status(self, request: Request) -> Response:
        """Each pool's replicas with their last reported stats and how old those are."""
        self._authorize_admin(request)
        now = time.time()
        pools = {}
        for name in self.pools:
            stats = pool_stats(name)
            pools[name] = {
                "replicas": pool_size(name),
                "live_replicas": live_replicas(name),
                "stats": [
                    s.flat() | {"prefix_hashes": len(s.prefix_hashes), "age_s": now - s.reported_at}
                    for s in stats or []
                ],
            }
        admission = {"running_sequences": self.admission.num_running, "queued_requests": self.admission.num_queued}
        for name, decision in (await asyncio.to_thread(self._autoscaler)).items():
            pools[name]["autoscaler"] = decision
        routing = {"migrations": self.orchestrator.migrations}
        if self.orchestrator.balancer is not None:
            routing["local_prefills"] = self.orchestrator.balancer.decisions[True]
            routing["pd_prefills"] = self.orchestrator.balancer.decisions[False]
            routing["contexts_waited"] = self.orchestrator.waiting_room.contexts_waited
        if self.role_keeper is not None:
            routing["role_changes"] = dict(self.role_keeper.changes)
            routing["sequences_shed"] = self.role_keeper.shed
        return JSONResponse({"model": self.model_id, "pools": pools, "admission": admission, "routing": routing})

    @admin.post("/scale")
    async def scale(self, request: Request) -> Response:
        """Pin an autoscaled pool at a size (``{"pool": "decode", "replicas": 2}``), or give it back
        to its policy (``"replicas": null``). The answer says the size the pool is held at
        (``target``: the pin within the pool's bounds) and the bounds."""
        self._authorize_admin(request)
        payload = await self._json_object(request)
        pool, replicas = payload.get("pool"), payload.get("replicas")
        if pool not in self.pools:
            raise bad_request(f"pool must be one of {sorted(self.pools)}", "pool")
        if pool not in self.autoscaled:
            raise bad_request(f"the {pool} pool has a fixed size; give it an autoscaling_config to scale it", "pool")
        if replicas is not None and (not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 1):
            raise bad_request("replicas must be a positive integer, or null to give the pool back to its policy", "replicas")
        await asyncio.to_thread(self.board.pin, self.app_name, pool, replicas)
        low, high = self.autoscaled[pool]
        target = None if replicas is None else min(max(replicas, low), high)
        return JSONResponse({"pool": pool, "pinned": replicas, "target": target, "min_replicas": low, "max_replicas": high})

    @admin.get("/integrity")
    async def integrity(self, request: Request) -> Response:
        """Run every replica's KV bookkeeping check now: per replica ``ok`` or what is wrong."""
        self._authorize_admin(request)

        async def check(pool: str, replica_id: str) -> str:
            new_call_context()  # concurrent calls to one pool must not share a request id
            try:
                await asyncio.wait_for(self.pools[pool].check_integrity.remote(replica_id=replica_id), 30)
            except Exception as error:  # noqa: BLE001 - reported per replica
                return str(getattr(error, "cause", None) or error)
            return "ok"

        targets = [(pool, replica_id) for pool in self.pools for replica_id in replica_ids(pool)]
        results = await asyncio.gather(*(check(pool, replica_id) for pool, replica_id in targets))
        report: dict[str, dict[str, str]] = {pool: {} for pool in self.pools}
        for (pool, replica_id), result in zip(targets, results):
            report[pool][replica_id] = result
        return JSONResponse({"ok": all(result == "ok" for result in results), "pools": report})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """Serve a LoRA adapter (vLLM's route: ``{"lora_name": ..., "lora_path": ...}``), once a
        replica of each pool has checked it against the model."""
        self._authorize_admin(request)
        payload = await self._json_object(request)
        name, path = _field(payload, "lora_name"), _field(payload, "lora_path")
        if name == self.model_id:
            raise bad_request(f"lora_name {name!r} is the base model's name", "lora_name")
        if name in self.loras:
            raise bad_request(f"the LoRA adapter {name!r} has already been loaded", "lora_name")
        for pool, handle in self.pools.items():
            new_call_context()
            try:
                await asyncio.wait_for(handle.check_lora.remote(name, path), LORA_CHECK_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise ApiError(503, f"the {pool} pool did not check the adapter within {LORA_CHECK_TIMEOUT_S:.0f} s", "service_unavailable", retry_after=5) from None
            except Exception as error:  # noqa: BLE001 - why it does not fit (400), or the pool's failure
                raise api_error_from(error) from None
        if not await asyncio.to_thread(self.board.set_lora, self.lora_registry, name, path, self.lora_modules):
            raise bad_request(f"the LoRA adapter {name!r} has already been loaded", "lora_name")
        self._set_loras(self.loras | {name: path})
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        """Serve a LoRA adapter no more (``{"lora_name": ...}``): requests naming it get a 404;
        those running finish with it."""
        self._authorize_admin(request)
        name = _field(await self._json_object(request), "lora_name")
        if not await asyncio.to_thread(self.board.set_lora, self.lora_registry, name, None, self.lora_modules):
            raise ApiError(404, f"the LoRA adapter {name!r} cannot be found", "not_found_error", "lora_name")
        self._set_loras({served: path for served, path in self.loras.items() if served != name})
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _field(payload: dict, name: str) -> str:
    value = payload.get(name)
    if not isinstance(value, str) or not value.strip():
        raise bad_request(f"{name} must be a non-empty string", name)
    return value


app.include_router(admin)
# Last in the module: Serve takes the routes bound to the class (and its bases) when it is decorated.
DuetIngress = serve.ingress(app)(DuetIngress)
