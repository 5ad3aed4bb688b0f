"""``duet status`` and ``duet scale``: what the CLI asks a running cluster through its router's
``/duet/`` endpoints (the key: ``DUET_ADMIN_API_KEY``), and the status as a table."""

from __future__ import annotations

import os
import time

from duet.cluster.deploy import DEFAULT_HOST, DEFAULT_PORT, ClusterState, DeployError


def _router_url(url: str | None) -> str:
    if url is not None:
        return url
    state = ClusterState.load()
    return state.urls[0] if state and state.urls else f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"


def scale(pool: str, replicas: int | None, url: str | None = None) -> dict:
    """Pin an autoscaled pool at ``replicas`` (None: back to its policy) through the router; its
    answer (``target``, the size the pool is held at, and the pool's ``min_replicas`` and
    ``max_replicas``, where the router gives them)."""
    import httpx

    url = _router_url(url)
    headers = _admin_headers()
    try:
        response = httpx.post(f"{url}/duet/scale", json={"pool": pool, "replicas": replicas}, headers=headers, timeout=30)
    except httpx.HTTPError as error:
        raise DeployError(f"no duet cluster answers at {url}: {error!r}") from None
    return _answer(response, f"{url}/duet/scale")


def _admin_headers() -> dict[str, str]:
    """The ``/duet/`` endpoints' key, from ``DUET_ADMIN_API_KEY`` (the router's ``admin_api_key``)."""
    key = os.environ.get("DUET_ADMIN_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _answer(response, where: str) -> dict:
    """A router's JSON answer; one that is not 200 raises its error's message."""
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if response.status_code != 200:
        error = answer.get("error") if isinstance(answer, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise DeployError(message or f"HTTP {response.status_code} from {where}: {response.text[:300]}")
    return answer if isinstance(answer, dict) else {}


def status(url: str | None = None) -> dict:
    import httpx

    url = _router_url(url)
    try:
        response = httpx.get(f"{url}/duet/status", headers=_admin_headers(), timeout=10)
    except httpx.HTTPError as error:
        raise DeployError(f"no duet cluster answers at {url}: {error!r}") from None
    return {"url": url} | _answer(response, f"{url}/duet/status")


def kv_dtype_shown(stats: dict) -> str:
    """The dtype a replica's KV cache is in (``kv_dtype``: bfloat16, int8, ...), not its setting
    (``kv_cache_dtype``: ``auto`` is the engine's dtype, shown as such where a replica does not
    report the dtype itself)."""
    short = {"float8_e4m3fn": "fp8_e4m3", "fp8": "fp8_e4m3"}  # vLLM's name, the one a config gives
    if stats.get("kv_dtype"):
        name = str(stats["kv_dtype"]).removeprefix("torch.")
        return short.get(name, name)
    setting = stats.get("kv_cache_dtype", "auto")
    return "as model" if setting == "auto" else short.get(setting, setting)


def cores_shown(stats: dict) -> str:
    """A replica's cores: its threads, and ``shared`` when it takes turns at all of its machine's."""
    threads = stats.get("threads", "?")
    return f"{threads} shared" if stats.get("shared_cores") else str(threads)


def wire_rate_shown(stats: dict) -> str:
    """What a replica's KV sends moved a second on the wire (their time less their waits for the
    forward): the rate the router prices a pull of a history this replica holds at."""
    rate = stats["transfer_wire_bytes"] / stats["transfer_wire_seconds"]
    return f"{rate / 1e9:.2f} GB/s" if rate >= 1e9 else f"{rate / 1e6:.0f} MB/s"


def format_status(report: dict) -> str:
    """The status as a table (a replica's role is the one it serves now: its pool's, or the
    other's, ``duet.router.roles``); a replica whose last report is older than ``REPLICA_SILENT_S``
    (it stopped reporting: dead, or stuck) is marked stale, with the age of its figures."""
    from duet.messages import REPLICA_SILENT_S

    lines = [f"duet at {report['url']}, model {report['model']}"]
    header = (
        f"{'pool':<10} {'replica':<10} {'node':<8} {'role':<8} {'running':>7} {'waiting':>7} {'kv used':>8} {'free blocks':>12} "
        f"{'kv dtype':>8} "
        f"{'transfers':>9} {'preempted':>9} {'cores':>8}"
    )
    lines.append(header)
    for pool, info in report["pools"].items():
        if not info["stats"]:
            lines.append(f"{pool:<10} {'(replicas: ' + str(info['replicas']) + ', no stats yet)'}")
        for stats in info["stats"]:
            lines.append(
                f"{pool:<10} {stats['replica_id']:<10} {(stats.get('node_id') or '-')[:8]:<8} {stats.get('stage', pool):<8} "
                f"{stats['num_running']:>7} {stats['num_waiting']:>7} "
                f"{stats['kv_usage']:>8.1%} {str(stats['num_free_blocks']) + '/' + str(stats['num_blocks']):>12} "
                f"{kv_dtype_shown(stats):>8} {stats['transfers']:>9} {stats['num_preemptions']:>9} {cores_shown(stats):>8}"
                + (
                    f"  tier: {stats['tier_blocks']}/{stats['tier_capacity_blocks']} blocks, {stats['tier_restored_blocks']} restored"
                    if stats.get("tier_capacity_blocks") else ""
                )
                + (
                    f"  LoRA: {', '.join(stats['loras'])} ({stats['lora_loads']} loaded, {stats['lora_evictions']} evicted)"
                    if stats.get("loras") else ""
                )
                + (f"  sends: {wire_rate_shown(stats)}" if stats.get("transfer_wire_seconds") else "")
                + (f"  STALE: last report {stats['age_s']:.0f} s ago" if stats["age_s"] > REPLICA_SILENT_S else "")
                + (f"  LEAK: {stats['integrity_failures']} failed idle checks" if stats["integrity_failures"] else "")
            )
    for pool, info in report["pools"].items():
        decision = info.get("autoscaler")
        if decision is None:
            lines.append(f"{pool} pool: {info['replicas']} replicas (fixed)")
        else:
            line = (
                f"{pool} pool: {decision['running']} running, target {decision['target']} replicas "
                f"(autoscaler: {decision['reason']}, {time.time() - decision['at']:.0f} s ago)"
            )
            numbers = decision.get("numbers") or {}
            if "planned" in numbers:  # sized ahead (``duet.cluster.capacity``): what for
                line += (
                    f"; planned {numbers['planned']} for {numbers['rate']:.2f} req/s of {numbers['prompt_tokens']:.0f} + "
                    f"{numbers['output_tokens']:.0f} tokens (profile's times x{numbers['correction']:.2g})"
                )
            lines.append(line)
    routing = report.get("routing", {})
    if routing:
        migrations = routing.get("migrations", {})
        line = f"router: sequences moved by KV {migrations.get('kv', 0)}, by recompute {migrations.get('recompute', 0)}"
        if "local_prefills" in routing:
            line += f"; prompts computed on decode {routing['local_prefills']}, on prefill {routing['pd_prefills']}"
            line += f", {routing.get('contexts_waited', 0)} waited for room"
        if routing.get("role_changes"):
            line += "; role changes " + ", ".join(f"{reason} {count}" for reason, count in sorted(routing["role_changes"].items()))
            line += f", sequences shed to even the decoders out {routing.get('sequences_shed', 0)}"
        lines.append(line)
    admission = report["admission"]
    lines.append(f"router admission: {admission['running_sequences']} sequences running, {admission['queued_requests']} requests queued")
    return "\n".join(lines)
