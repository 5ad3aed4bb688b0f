"""The import direction holds (docs/design.md): ``cluster`` -> ``router``, the role folders and
``kv_transfer`` -> ``duet`` (the engine core) -> ``kernels``. Read from the source, so it fails
on an import against the direction wherever it is written: at the top, inside a function, or
behind ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Folder -> the folders (installed as ``duet.<folder>``) it may import; ``duet`` is the core.
ALLOWED = {
    "kernels": set(),
    "duet": {"kernels"},
    "kv_transfer": {"duet", "kernels"},
    "prefill_node": {"duet", "kernels"},
    "decode_node": {"duet", "kernels"},
    "router": {"duet"},
    "cluster": {"router", "prefill_node", "decode_node", "kv_transfer", "duet", "kernels", "benchmarks"},
}
FOLDERS = set(ALLOWED) | {"benchmarks"}
# Third-party packages a folder must not import: the core runs without a cluster, the router
# without tensors.
FORBIDDEN_PACKAGES = {"duet": {"ray", "fastapi", "starlette"}, "kernels": {"ray", "fastapi"}, "router": {"torch"}}


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in a file, relative ones resolved."""
    package = path.relative_to(root).parent.parts
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(("duet",) + package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return found


def _folder_of(module: str) -> str | None:
    """The top-level folder an import names (``duet.router.pd`` -> ``router``; ``duet.config`` -> ``duet``)."""
    parts = module.split(".")
    if parts[0] != "duet":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else "duet"


def _violations(folder: str, root: Path = ROOT) -> list[str]:
    wrong = []
    for path in sorted((root / folder).rglob("*.py")):
        for line, module in _imports(path, root):
            target = _folder_of(module)
            where = f"{path.relative_to(root)}:{line} imports {module}"
            if target is not None and target != folder and target not in ALLOWED[folder]:
                wrong.append(where)
            if module.split(".")[0] in FORBIDDEN_PACKAGES.get(folder, ()):
                wrong.append(where)
    return wrong


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_run_one_way(folder):
    assert _violations(folder) == []


def test_the_check_sees_an_import_against_the_direction(tmp_path):
    """The rule itself: a router module importing the cluster is caught, inside a function too."""
    source = tmp_path / "router" / "bad.py"
    source.parent.mkdir()
    source.write_text("def f():\n    from duet.cluster.autoscale import pin\n    from .errors import ApiError\n")
    assert _violations("router", tmp_path) == ["router/bad.py:2 imports duet.cluster.autoscale"]
