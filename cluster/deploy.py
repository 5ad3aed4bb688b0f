"""``duet up`` and ``duet down``: run a Serve config file on a Ray cluster (``duet status`` and
``duet scale`` ask the running cluster: ``duet.cluster.operate``).

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


def _check_keys(path, raw: dict) -> None:
    """``DeployError`` for a key Serve's schema does not have, at the top or in an application
    (Serve's schema ignores it: a ``router:`` section at the top, meant for an application's
    ``args``, was dropped without a word)."""
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    from duet.cluster.config import AppArgs

    duet_sections = set(AppArgs.model_fields)
    places = [("", raw, set(ServeDeploySchema.model_fields))]
    places += [(f"applications[{index}].", app, set(ServeApplicationSchema.model_fields)) for index, app in enumerate(raw["applications"])]
    for where, section, known in places:
        if not isinstance(section, dict):
            raise DeployError(f"{path}: {where.rstrip('.') or 'the file'} must be a mapping")
        for key in section:
            if key not in known:
                hint = f"; duet's '{key}' goes under applications[i].args" if key in duet_sections else f"; Serve's keys here: {', '.join(sorted(known))}"
                raise DeployError(f"{path}: {where}{key} is not a key of Serve's config{hint}")


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
        _check_keys(path, raw)  # first: an application that is no mapping is said so
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


def ray_cli() -> list[str]:
    """Ray's command line under this interpreter: the cluster it starts runs its workers with the
    Python (and so the duet) that runs ``duet up``, not with whichever ``ray`` is first on PATH."""
    return [sys.executable, "-m", "ray.scripts.scripts"]


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
        *ray_cli(), "start", "--head", f"--num-cpus={max(2, os.cpu_count() or 2)}",
        "--include-dashboard=false", "--disable-usage-stats", f"--object-store-memory={256 * 2**20}",
    ]
    if loopback:
        command.append("--node-ip-address=127.0.0.1")
    print("starting a local Ray cluster: ray " + " ".join(command[len(ray_cli()):]), flush=True)
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
        subprocess.run([*ray_cli(), "stop", "--force"], capture_output=True, text=True)
    state_path().unlink(missing_ok=True)
    return True
