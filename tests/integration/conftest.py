"""One real cluster for the integration tests: Ray started by ``duet up`` in the background,
Serve, two applications of SmolLM2 (``pd`` at ``/``, ``colocated`` at ``/colocated``), one
PD application of the tiny random Llama for load and fault tests (``stress`` at ``/stress``:
fast to restart, generous admission, two decode replicas) and real HTTP on 127.0.0.1; tests of
scaling deploy applications of their own beside them (``deploy``). Torn down by ``duet down``
at the end of the session. Logical CPUs: 2, shared out so that every replica fits."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import pytest
import yaml

API_KEY = "test-key"
ADMIN_KEY = "test-admin-key"  # the /duet/ endpoints' own
MAX_MODEL_LEN = 1024
MAX_RUNNING, MAX_QUEUED = 2, 2
MAX_BODY_BYTES = 64 * 1024


STRESS_MODEL_LEN = 1024


@dataclass(frozen=True)
class Cluster:
    url: str
    colocated_url: str
    stress_url: str
    tiny_model_dir: str
    listeners_before: frozenset[str]  # TCP listening addresses on the machine before `duet up`
    api_key: str = API_KEY
    admin_key: str = ADMIN_KEY

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    def client(self, colocated: bool = False):
        import openai

        base = self.colocated_url if colocated else self.url
        return openai.OpenAI(base_url=f"{base}/v1", api_key=self.api_key, max_retries=0, timeout=120)

    def integrity(self, url: str | None = None) -> dict:
        """Every replica's KV bookkeeping check of one application (default: ``pd``)."""
        import httpx

        return httpx.get(f"{url or self.url}/duet/integrity", headers=self.admin_headers, timeout=60).json()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def _engine() -> dict:
    return {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_gib": 0.25, "max_num_seqs": 16}


def _pool(**extra) -> dict:
    return {"ray_actor_options": {"num_cpus": 0.4}, "engine": {"num_threads": 1}, **extra}


def listening_addresses() -> frozenset[str]:
    """``address:port`` of every listening TCP socket on this machine (from /proc/net)."""
    found = set()
    for name, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in open(name).read().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":  # LISTEN
                continue
            address, port = local.split(":")
            found.add(f"{_address(address, width)}:{int(port, 16)}")
    return frozenset(found)


def _address(hex_address: str, width: int) -> str:
    import ipaddress

    raw = bytes.fromhex(hex_address)
    # /proc prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def cluster_config(port: int, tiny_model_dir: str) -> dict:
    pd = {
        "model_id": "smollm2",
        "model": "smollm2",
        "mode": "pd",
        "engine": _engine() | {"kv_offload": {"tier": "cpu", "size_gib": 0.05}},  # a second KV tier behind both pools
        "prefill": _pool(),
        # The PD application decodes with n-gram speculation; the colocated one without.
        "decode": _pool(local_prefill_threshold=16) | {"engine": {"num_threads": 1, "speculative_config": NGRAM}},
        "router": {
            "ray_actor_options": {"num_cpus": 0},
            "max_running_sequences": MAX_RUNNING,
            "max_queued_requests": MAX_QUEUED,
            "max_body_bytes": MAX_BODY_BYTES,
            "api_key": API_KEY,
            "admin_api_key": ADMIN_KEY,
        },
    }
    colocated = {
        "model_id": "smollm2",
        "model": "smollm2",
        "mode": "colocated",
        "engine": _engine(),
        "decode": _pool(),
        "router": {"ray_actor_options": {"num_cpus": 0}, "api_key": API_KEY, "admin_api_key": ADMIN_KEY},
    }
    stress = {
        "model_id": "tiny",
        "model": tiny_model_dir,
        "mode": "pd",
        # Every prompt goes through the prefill pool; room for a few hundred sequences at once.
        "engine": {"max_model_len": STRESS_MODEL_LEN, "num_kv_blocks": 8192, "max_num_seqs": 64, "max_num_batched_tokens": 1024},
        "prefill": {"ray_actor_options": {"num_cpus": 0.2}, "engine": {"num_threads": 1}},
        # Two decode replicas: a sequence whose replica dies goes on on the other.
        "decode": {
            "num_replicas": 2, "ray_actor_options": {"num_cpus": 0.1}, "engine": {"num_threads": 1}, "adaptive_local_prefill": False,
        },
        "router": {"ray_actor_options": {"num_cpus": 0}, "max_running_sequences": 512, "max_queued_requests": 512},
    }
    app = {"import_path": "duet.cluster.app:build_app"}
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            app | {"name": "pd", "route_prefix": "/", "args": pd},
            app | {"name": "colocated", "route_prefix": "/colocated", "args": colocated},
            app | {"name": "stress", "route_prefix": "/stress", "args": stress},
        ],
    }


def _ray_is_running() -> bool:
    import ray

    try:
        ray.init(address="auto", logging_level="WARNING")
    except ConnectionError:
        return False
    ray.shutdown()
    return True


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir):
    """The stress application's tiny Llama, with SmolLM2's tokenizer (49,152 tokens) here, not the
    small one of the other tests' (``tests/conftest.py``): these tests load SmolLM2 anyway, their
    prompts are ids up to 49,000 (``client.random_prompt``), and their loads and timings were
    set for this model's LM head."""
    from tests.conftest import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory, smollm2_dir, tiny_llama_dir):
    from duet.cluster.deploy import down, up
    from tests.conftest import pin_cpu_rules

    if _ray_is_running():
        # `duet up` would join it, and its workers would run whatever code that cluster has.
        pytest.fail("a Ray cluster is already running on this machine; stop it (`ray stop`) so the tests start their own")
    root = tmp_path_factory.mktemp("cluster")
    config = root / "cluster.yaml"
    config.write_text(yaml.safe_dump(cluster_config(_free_port(), str(tiny_llama_dir))))
    previous = os.environ.get("DUET_STATE_FILE")
    os.environ["DUET_STATE_FILE"] = str(root / "state.json")
    listeners_before = listening_addresses()
    pin_cpu_rules()
    try:
        state = up(str(config), health_timeout_s=300)
        yield Cluster(*state.urls, tiny_model_dir=str(tiny_llama_dir), listeners_before=listeners_before)
    finally:
        down()
        if previous is None:
            os.environ.pop("DUET_STATE_FILE", None)
        else:
            os.environ["DUET_STATE_FILE"] = previous


@pytest.fixture(scope="session")
def tiny_offline(tiny_llama_dir):
    """Greedy tokens of the offline engine on the tiny model (the stress application's), by prompt."""
    from duet import LLM, SamplingParams
    from tests.integration.client import NEW_TOKENS

    llm = LLM(model=str(tiny_llama_dir), max_model_len=1024, num_kv_blocks=4096, max_num_seqs=128)
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def tokens(prompts: list[list[int]], max_tokens: int = NEW_TOKENS) -> list[list[int]]:
        missing = [prompt for prompt in prompts if (tuple(prompt), max_tokens) not in cache]
        if missing:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
            for prompt, output in zip(missing, llm.generate(missing, params)):
                cache[(tuple(prompt), max_tokens)] = output.outputs[0].token_ids
        return [cache[(tuple(prompt), max_tokens)] for prompt in prompts]

    tokens.llm = llm
    return tokens


@pytest.fixture(scope="session")
def ray_driver(cluster):
    """This process connected to the cluster's Ray (to kill replicas, deploy applications)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="auto", logging_level="WARNING")
    yield ray


@pytest.fixture
def deploy(cluster, ray_driver):
    """Deploy an application of the tiny model beside the session's (``deploy(name, args)``
    gives its URL once healthy); deleted at the end of the test."""
    import httpx
    from ray import serve

    from duet.cluster.app import build_app

    names = []

    def run(name: str, args: dict) -> str:
        names.append(name)
        serve.run(build_app({"model_id": "tiny", "model": cluster.tiny_model_dir} | args), name=name, route_prefix=f"/{name}")
        url = f"{cluster.url}/{name}"
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
        return url

    yield run
    for name in names:
        serve.delete(name)
