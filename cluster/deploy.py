"""``duet up``, ``duet status`` and ``duet down``: run a Serve config file on a Ray cluster.

``up`` joins the running Ray cluster if there is one, else starts a local head node in the
background (``ray start``), deploys every application of the file and waits until each answers
``/health``. What it started is written to a state file so that ``down`` stops exactly that.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from duet.cluster.app import AppConfigError, parse_args

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000
HEALTH_TIMEOUT_S = 600.0


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
        http = raw.get("http_options") or {}
        for index, app in enumerate(raw["applications"]):
            if app.get("import_path") != "duet.cluster.app:build_app":
                raise DeployError(f"{path}: applications[{index}].import_path must be duet.cluster.app:build_app")
            try:
                parse_args(app.get("args") or {})
            except AppConfigError as error:
                raise DeployError(f"{path}: applications[{index}].args:\n{error}") from None
        return cls(http.get("host", DEFAULT_HOST), int(http.get("port", DEFAULT_PORT)), raw.get("proxy_location", "HeadOnly"), raw["applications"])

    def url(self, app: dict) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}{(app.get('route_prefix') or '/').rstrip('/')}"


def _ray_executable() -> str:
    candidate = Path(sys.executable).parent / "ray"
    return str(candidate) if candidate.exists() else (shutil.which("ray") or "ray")


def _connect_or_start_ray() -> bool:
    """Connect to the running Ray cluster, or start a local head node; True if started here."""
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
    print("starting a local Ray cluster: " + " ".join(command[1:]), flush=True)
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise DeployError(f"ray start failed:\n{completed.stderr[-2000:]}")
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


def up(config_path: str, health_timeout_s: float = HEALTH_TIMEOUT_S) -> ClusterState:
    from ray import serve

    from duet.cluster.app import build_app

    serve_file = ServeFile.read(config_path)
    state = ClusterState(started_ray=_connect_or_start_ray())
    state.save()
    try:
        serve.start(http_options={"host": serve_file.host, "port": serve_file.port}, proxy_location=serve_file.proxy_location)
        for app in serve_file.applications:
            name = app.get("name", "default")
            state.apps.append(name)  # recorded first, so that a failed deploy is cleaned up too
            state.save()
            print(f"deploying {name} ...", flush=True)
            serve.run(build_app(app.get("args") or {}), name=name, route_prefix=app.get("route_prefix", "/"))
            state.urls.append(serve_file.url(app))
            state.save()
        for url in state.urls:
            _wait_healthy(url, health_timeout_s)
    except Exception as error:
        down()
        raise DeployError(f"could not bring {config_path} up: {error}") from error
    return state


def down() -> bool:
    """Delete the applications ``up`` deployed and, if ``up`` started it, stop the local Ray
    cluster; other applications on a shared cluster are left alone."""
    import ray
    from ray import serve

    state = ClusterState.load()
    if state is None:
        return False
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


def status(url: str | None = None) -> dict:
    import httpx

    if url is None:
        state = ClusterState.load()
        url = state.urls[0] if state and state.urls else f"http://{DEFAULT_HOST}:{DEFAULT_PORT}"
    try:
        response = httpx.get(f"{url}/duet/status", timeout=10)
        response.raise_for_status()
    except httpx.HTTPError as error:
        raise DeployError(f"no duet cluster answers at {url}: {error!r}") from None
    return {"url": url} | response.json()


def format_status(report: dict) -> str:
    lines = [f"duet at {report['url']}, model {report['model']}"]
    header = f"{'pool':<10} {'replica':<10} {'running':>7} {'waiting':>7} {'kv used':>8} {'free blocks':>12} {'transfers':>9} {'preempted':>9}"
    lines.append(header)
    for pool, info in report["pools"].items():
        if not info["stats"]:
            lines.append(f"{pool:<10} {'(replicas: ' + str(info['replicas']) + ', no stats yet)'}")
        for stats in info["stats"]:
            lines.append(
                f"{pool:<10} {stats['replica_id']:<10} {stats['num_running']:>7} {stats['num_waiting']:>7} "
                f"{stats['kv_usage']:>8.1%} {str(stats['num_free_blocks']) + '/' + str(stats['num_blocks']):>12} "
                f"{stats['transfers']:>9} {stats['num_preemptions']:>9}"
            )
    admission = report["admission"]
    lines.append(f"router admission: {admission['running']} running, {admission['queued']} queued")
    return "\n".join(lines)
