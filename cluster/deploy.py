"""``duet up``, ``duet status`` and ``duet down``: run a Serve config file on a Ray cluster.

``up`` joins the running Ray cluster if there is one, else starts a local head node in the
background (``ray start``), deploys every application of the file and waits until each answers
``/health``. What it started is written to a state file so that ``down`` stops exactly that.

A file whose HTTP host is a loopback address is a local cluster: everything it starts listens
on 127.0.0.1 only. Ray binds its own servers (GCS, raylet, client server, agents) to the node's
external address unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` is set (then the node is
127.0.0.1, as Ray does on a laptop); that is read when ray is imported, in every process that
connects, so ``duet`` sets it before importing ray (``use_loopback_ray``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from duet.router.serve_internals import LOOPBACK_RAY_ENV

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
HEALTH_TIMEOUT_S = 600.0
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def use_loopback_ray() -> None:
    """Make this process (and what it starts) run or join a Ray cluster on 127.0.0.1 only.
    Must happen before ray is first imported."""
    if "ray" in sys.modules and os.environ.get(LOOPBACK_RAY_ENV) != "0":
        raise DeployError(
            f"ray was imported before {LOOPBACK_RAY_ENV}=0 was set; a local (127.0.0.1) cluster needs it "
            "set first: run `duet up` from the command line, or set it in the environment"
        )
    os.environ[LOOPBACK_RAY_ENV] = "0"
    _settle_ray_auth_mode()


RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"  # Ray's documented switch: "token" or "disabled"
RAY_AUTH_OFF_NOTE = (
    "Ray token authentication is off for this cluster: it listens on 127.0.0.1 only, but any user of this machine "
    "can reach it. `ray get-auth-token --generate`, then `duet down` and `duet up`, turns it on"
)


def ray_token_exists() -> bool:
    """Whether Ray finds an authentication token where it looks: ``RAY_AUTH_TOKEN``, the file at
    ``RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token`` (written by ``ray get-auth-token --generate``
    and by any ``ray.init()`` that starts a cluster of its own)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return True
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").is_file()


def ray_token_auth_on() -> bool:
    """Ray's choice for a local cluster: ``RAY_AUTH_MODE`` where set, else on where a token exists."""
    mode = os.environ.get(RAY_AUTH_MODE_ENV)
    return mode.lower() == "token" if mode is not None else ray_token_exists()


def _settle_ray_auth_mode() -> None:
    """Where a token exists and ``RAY_AUTH_MODE`` is unset, Ray 2.60 turns token authentication on
    for the local cluster it finds or starts, and warns so ("Token authentication is enabled for
    this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out") in every process that connects
    (``ray/_private/authentication/authentication_token_setup.py``). ``RAY_AUTH_MODE=token`` makes
    the same choice without the warning; Ray reads it when imported, and ``ray start`` and the
    cluster's processes inherit it. A mode the user set is theirs."""
    if "ray" not in sys.modules and RAY_AUTH_MODE_ENV not in os.environ and ray_token_exists():
        os.environ[RAY_AUTH_MODE_ENV] = "token"


class DeployError(RuntimeError):
    """The cluster could not be brought up healthy; the message says why."""


def state_path() -> Path:
    """What ``up`` started; ``DUET_STATE_FILE`` overrides (tests keep theirs apart)."""
    if os.environ.get("DUET_STATE_FILE"):
        return Path(os.environ["DUET_STATE_FILE"])
    return Path(os.environ.get("DUET_CACHE_DIR", Path.home() / ".cache" / "duet")) / "cluster.json"


@dataclass
class ClusterState:
    urls: list[str] = field(default_factory=list)
    apps: list[str] = field(default_factory=list)
    started_ray: bool = False
    loopback: bool = False  # the Ray cluster listens on 127.0.0.1 only
    session: str = ""  # the Ray session (one per start of a cluster) it describes

    def save(self) -> None:
        state_path().parent.mkdir(parents=True, exist_ok=True)
        state_path().write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls) -> ClusterState | None:
        try:
            return cls(**json.loads(state_path().read_text()))
        except (OSError, ValueError, TypeError):
            return None


@dataclass(frozen=True)
class ServeFile:
    """The parts of a Serve config file that ``duet up`` acts on."""

    host: str
    port: int
    proxy_location: str
    applications: list[dict]

    @classmethod
    def read(cls, path: str | Path) -> ServeFile:
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as error:
            raise DeployError(f"cannot read {path}: {error}") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("applications"), list) or not raw["applications"]:
            raise DeployError(f"{path}: a Serve config needs a non-empty 'applications' list")
        from duet.cluster.config import AppConfigError, parse_args

        http = raw.get("http_options") or {}
        if http.get("host", DEFAULT_HOST) in LOOPBACK_HOSTS:
            use_loopback_ray()  # before the args' validation imports ray (Serve's autoscaling config)
        names = [app.get("name", "default") for app in raw["applications"]]
        prefixes = [app.get("route_prefix", "/") for app in raw["applications"]]
        for kind, values in (("name", names), ("route_prefix", prefixes)):
            if len(set(values)) < len(values):
                raise DeployError(f"{path}: two applications have the same {kind} (an application without a name is 'default')")
        for index, app in enumerate(raw["applications"]):
            if app.get("import_path") != "duet.cluster.app:build_app":
                raise DeployError(f"{path}: applications[{index}].import_path must be duet.cluster.app:build_app")
            try:
                parse_args(app.get("args") or {})
            except AppConfigError as error:
                raise DeployError(f"{path}: applications[{index}].args:\n{error}") from None
        return cls(http.get("host", DEFAULT_HOST), int(http.get("port", DEFAULT_PORT)), raw.get("proxy_location", "HeadOnly"), raw["applications"])

    @property
    def loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS

    def url(self, app: dict) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}{(app.get('route_prefix') or '/').rstrip('/')}"


def _ray_executable() -> str:
    candidate = Path(sys.executable).parent / "ray"
    return str(candidate) if candidate.exists() else (shutil.which("ray") or "ray")


def _connect_or_start_ray(loopback: bool) -> bool:
    """Connect to the running Ray cluster, or start a local head node; True if started here."""
    if loopback:
        use_loopback_ray()
    import ray

    try:
        ray.init(address="auto", logging_level="WARNING", log_to_driver=False)
        return False
    except ConnectionError:
        pass
    command = [
        _ray_executable(), "start", "--head", f"--num-cpus={max(2, os.cpu_count() or 2)}",
        "--include-dashboard=false", "--disable-usage-stats", f"--object-store-memory={256 * 2**20}",
    ]
    if loopback:
        command.append("--node-ip-address=127.0.0.1")
    print("starting a local Ray cluster: " + " ".join(command[1:]), flush=True)
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise DeployError(f"ray start failed:\n{completed.stderr[-2000:]}")
    if loopback and not ray_token_auth_on():
        print(RAY_AUTH_OFF_NOTE, flush=True)  # Ray's own warning went to `ray start`'s captured output
    ray.init(address="auto", logging_level="WARNING", log_to_driver=False)
    return True


def _wait_healthy(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            response = httpx.get(f"{url}/health", timeout=15)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}: {response.text[:300]}"
        except httpx.HTTPError as error:
            last = repr(error)
        time.sleep(1.0)
    raise DeployError(f"{url} did not become healthy within {timeout_s:.0f} s: {last}")


@contextlib.contextmanager
def _quiet_serve_restart_notice():
    """``serve.run`` starts Serve again and, finding it up, logs that "new http_options will not
    be applied": noise, since ``up`` started it a moment before with the file's own options."""

    def keep(record: logging.LogRecord) -> bool:
        return "will not be applied" not in record.getMessage()

    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addFilter(keep)
    try:
        yield
    finally:
        serve_logger.removeFilter(keep)


def up(config_path: str, health_timeout_s: float = HEALTH_TIMEOUT_S) -> ClusterState:
    """Deploy a config's applications, starting a local Ray cluster if none runs (see ``joined_state``
    for one run again while an earlier ``up``'s cluster runs)."""
    serve_file = ServeFile.read(config_path)
    previous = ClusterState.load()
    started_ray = _connect_or_start_ray(serve_file.loopback)
    import ray
    from ray import serve

    from duet.cluster.app import build_app

    state, joined = joined_state(previous, serve_file, started_ray, ray.get_runtime_context().get_session_name())
    state.save()
    try:
        serve.start(http_options={"host": serve_file.host, "port": serve_file.port}, proxy_location=serve_file.proxy_location)
        urls = []
        for app in serve_file.applications:
            name = app.get("name", "default")
            if name not in state.apps:
                state.apps.append(name)  # recorded first, so that a failed deploy is cleaned up too
            state.save()
            print(f"deploying {name} ...", flush=True)
            with _quiet_serve_restart_notice():
                serve.run(build_app(app.get("args") or {}), name=name, route_prefix=app.get("route_prefix", "/"))
            urls.append(serve_file.url(app))
            state.urls = list(dict.fromkeys([*state.urls, urls[-1]]))
            state.save()
        for url in urls:
            _wait_healthy(url, health_timeout_s)
    except Exception as error:
        if not joined:
            down()
            raise DeployError(f"could not bring {config_path} up: {error}") from error
        raise DeployError(
            f"could not bring {config_path} up: {error}\nThe earlier `duet up`'s cluster is left as it is (this one's "
            "applications included); `duet down` stops it all"
        ) from error
    return state


def joined_state(previous: ClusterState | None, serve_file: ServeFile, started_ray: bool, session: str) -> tuple[ClusterState, bool]:
    """What an ``up`` records: a state of its own, or (True) the earlier ``up``'s when that one's
    cluster is the one it joined (the same Ray session): it then deploys into it (an application
    of the same name is redeployed) and adds to what ``down`` stops, the Ray it started among
    them. A state of another session (its Ray gone, or another cluster running) is left behind."""
    if started_ray or previous is None or previous.session != session:
        return ClusterState(loopback=serve_file.loopback, started_ray=started_ray, session=session), False
    served = {url.split("/", 3)[2] for url in previous.urls}
    if served and served != {serve_file.url({}).split("/", 3)[2]}:
        raise DeployError(
            f"the cluster an earlier `duet up` started serves on {', '.join(sorted(served))} and Serve keeps its HTTP "
            "options: give this config the same http_options, or run `duet down` first"
        )
    return replace(previous, apps=list(previous.apps), urls=list(previous.urls)), True


def down() -> bool:
    """Delete the applications ``up`` deployed and, if ``up`` started it, stop the local Ray
    cluster; other applications on a shared cluster are left alone."""
    state = ClusterState.load()
    if state is None:
        return False
    if state.loopback:
        use_loopback_ray()
    import ray
    from ray import serve

    try:
        if state.apps and not state.started_ray:
            if not ray.is_initialized():
                ray.init(address="auto", logging_level="WARNING", log_to_driver=False)
            for app in state.apps:
                serve.delete(app)
    except ConnectionError:
        pass
    finally:
        if ray.is_initialized():
            ray.shutdown()
    if state.started_ray:
        subprocess.run([_ray_executable(), "stop", "--force"], capture_output=True, text=True)
    state_path().unlink(missing_ok=True)
    return True


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


def format_status(report: dict) -> str:
    """The status as a table; a replica whose last report is older than ``REPLICA_SILENT_S``
    (it stopped reporting: dead, or stuck) is marked stale, with the age of its figures."""
    from duet.messages import REPLICA_SILENT_S

    lines = [f"duet at {report['url']}, model {report['model']}"]
    header = (
        f"{'pool':<10} {'replica':<10} {'running':>7} {'waiting':>7} {'kv used':>8} {'free blocks':>12} {'kv dtype':>8} "
        f"{'transfers':>9} {'preempted':>9} {'cores':>8}"
    )
    lines.append(header)
    for pool, info in report["pools"].items():
        if not info["stats"]:
            lines.append(f"{pool:<10} {'(replicas: ' + str(info['replicas']) + ', no stats yet)'}")
        for stats in info["stats"]:
            lines.append(
                f"{pool:<10} {stats['replica_id']:<10} {stats['num_running']:>7} {stats['num_waiting']:>7} "
                f"{stats['kv_usage']:>8.1%} {str(stats['num_free_blocks']) + '/' + str(stats['num_blocks']):>12} "
                f"{kv_dtype_shown(stats):>8} {stats['transfers']:>9} {stats['num_preemptions']:>9} {cores_shown(stats):>8}"
                + (f"  STALE: last report {stats['age_s']:.0f} s ago" if stats["age_s"] > REPLICA_SILENT_S else "")
                + (f"  LEAK: {stats['integrity_failures']} failed idle checks" if stats["integrity_failures"] else "")
            )
    for pool, info in report["pools"].items():
        decision = info.get("autoscaler")
        if decision is None:
            lines.append(f"{pool} pool: {info['replicas']} replicas (fixed)")
        else:
            lines.append(
                f"{pool} pool: {decision['running']} running, target {decision['target']} replicas "
                f"(autoscaler: {decision['reason']}, {time.time() - decision['at']:.0f} s ago)"
            )
    routing = report.get("routing", {})
    if routing:
        migrations = routing.get("migrations", {})
        line = f"router: sequences moved by KV {migrations.get('kv', 0)}, by recompute {migrations.get('recompute', 0)}"
        if "local_prefills" in routing:
            line += f"; prompts computed on decode {routing['local_prefills']}, on prefill {routing['pd_prefills']}"
            line += f", {routing.get('contexts_waited', 0)} waited for room"
        lines.append(line)
    admission = report["admission"]
    lines.append(f"router admission: {admission['running_sequences']} sequences running, {admission['queued_requests']} requests queued")
    return "\n".join(lines)
