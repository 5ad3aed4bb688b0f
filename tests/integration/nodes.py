"""Several Ray nodes on this machine: Ray's own multi-node test cluster (``ray.cluster_utils``), a
raylet per node with its own CPUs and labels, held by a child process the test talks to over
its stdin and stdout, so that the test's own process stays a driver of the session's cluster.

    python -m tests.integration.nodes '{"head": {"num_cpus": 1}, "decode-a": {"num_cpus": 1, "labels": {...}}}'

The first node named is the head. The process prints one JSON line when the nodes are up
(``{"address": ..., "nodes": {name: node_id}}``), then answers each line it reads:
``remove NAME`` removes that node (its raylet and every process on it are killed, as when a
machine is lost) and prints ``{"removed": NAME}``; ``actors`` prints the live actors' classes and
nodes (``{"actors": [{"class": ..., "node_id": ...}]}``); ``stop`` (or the end of its input) shuts the
cluster down. Its Ray runs from ``RAY_TMPDIR`` (set by ``start``), apart from the session's
cluster: ``ray.init(address="auto")``, ``duet up`` and ``duet down`` with that variable find
this cluster and no other."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

READY_TIMEOUT_S = 180
NODE_MEMORY = 96 * 2**20  # each node's object store


def _serve(layout: dict[str, dict]) -> None:
    from duet.cluster.deploy import use_loopback_ray

    use_loopback_ray()  # every node on 127.0.0.1, as `duet up` of a loopback config expects
    from ray.cluster_utils import Cluster

    names = list(layout)
    common = {"include_dashboard": False, "object_store_memory": NODE_MEMORY}
    cluster = Cluster(initialize_head=True, head_node_args=common | _node_args(layout[names[0]]))
    nodes = {names[0]: cluster.head_node}
    for name in names[1:]:
        nodes[name] = cluster.add_node(**common | _node_args(layout[name]))
    cluster.wait_for_nodes()
    print(json.dumps({"address": cluster.address, "nodes": {name: node.node_id for name, node in nodes.items()}}), flush=True)
    try:
        for line in sys.stdin:
            command, _, name = line.strip().partition(" ")
            if command == "stop":
                break
            if command == "remove" and name in nodes and name != names[0]:
                cluster.remove_node(nodes.pop(name), allow_graceful=False)
                print(json.dumps({"removed": name}), flush=True)
            elif command == "actors":
                table = [actor for actor in cluster.global_state.actor_table(None).values() if actor["State"] == "ALIVE"]
                alive = [{"class": actor["ActorClassName"], "node_id": actor["Address"]["NodeID"]} for actor in table]
                print(json.dumps({"actors": alive}), flush=True)
            elif command:
                print(json.dumps({"error": f"cannot {line.strip()!r}"}), flush=True)
    finally:
        cluster.shutdown()


def _node_args(spec: dict) -> dict:
    return {"num_cpus": spec.get("num_cpus", 1), "labels": spec.get("labels") or {}, "resources": spec.get("resources") or {}}


class Nodes:
    """The child process's cluster, seen from the test."""

    def __init__(self, process: subprocess.Popen, ready: dict, env: dict[str, str]):
        self.process, self.address, self.node_ids, self.env = process, ready["address"], ready["nodes"], env

    def remove(self, name: str) -> None:
        self.process.stdin.write(f"remove {name}\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline() or "{}")
        assert answer == {"removed": name}, answer

    def actors(self) -> list[dict]:
        """The cluster's live actors: ``{"class": ..., "node_id": ...}`` each."""
        self.process.stdin.write("actors\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())["actors"]

    def run(self, *command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        """A command (``duet up``, ``duet down``) against this cluster, its output kept."""
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout)


@contextmanager
def start(layout: dict[str, dict], workdir: Path):
    """The nodes of ``layout`` up, in a child process; shut down on leaving."""
    # A short path: Ray's sockets live under it, and a Unix socket's path holds 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="duet-nodes-", dir="/tmp")
    env = os.environ | {"RAY_TMPDIR": ray_tmp, "DUET_STATE_FILE": str(workdir / "state.json")}
    env.pop("RAY_ADDRESS", None)
    log = open(workdir / "nodes.log", "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.nodes", json.dumps(layout)], cwd=Path(__file__).resolve().parents[2],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
    )
    try:
        line = _read_line(process, READY_TIMEOUT_S)
        if not line:
            raise RuntimeError(f"the nodes did not come up:\n{(workdir / 'nodes.log').read_text()[-3000:]}")
        yield Nodes(process, json.loads(line), env)
    finally:
        if process.poll() is None:
            process.stdin.write("stop\n")
            process.stdin.flush()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
        log.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _read_line(process: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            return ""
    return process.stdout.readline()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
