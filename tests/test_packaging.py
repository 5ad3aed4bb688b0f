"""Our folder names must never shadow other distributions' packages.

``kernels`` is a Hugging Face package that transformers probes for; if ``import kernels``
found ours, transformers would take it for the hub-kernels library and fail on import.
"""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_installed_distribution_owns_only_the_duet_namespace():
    distributions = importlib.metadata.packages_distributions()
    owned = sorted(name for name, dists in distributions.items() if "duet" in dists)
    assert owned == ["duet"], f"duet installs top-level packages {owned}; everything must live under duet."


@pytest.mark.slow  # a fresh interpreter importing transformers: seconds
def test_transformers_does_not_mistake_our_kernels_folder_for_hf_kernels():
    # Run from the repository root, where a bare `kernels/` folder is on the path if anything is.
    code = (
        "from transformers.utils.import_utils import is_kernels_available\n"
        "import transformers.integrations.hub_kernels\n"
        "from transformers import LlamaForCausalLM\n"
        "print(is_kernels_available())\n"
    )
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == str(_installed("kernels"))


def test_a_bare_kernels_import_from_the_root_reaches_the_distribution_that_owns_the_name(tmp_path):
    """From the checkout's root (first on sys.path), `import kernels` must give another owner of the
    name where one is on the path (a stand-in for the Hugging Face distribution here), and an empty
    namespace package where none is: never this checkout's folder."""
    owner = tmp_path / "site" / "kernels"
    owner.mkdir(parents=True)
    (owner / "__init__.py").write_text("OWNER = 'the distribution'\n")
    root = Path(__file__).resolve().parents[1]
    code = "import kernels, duet.kernels\nprint(getattr(kernels, 'OWNER', None), getattr(kernels, '__file__', None), duet.kernels.__name__)\n"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    with_owner = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert with_owner.returncode == 0, with_owner.stderr[-2000:]
    assert with_owner.stdout.split() == ["the", "distribution", str(owner / "__init__.py"), "duet.kernels"]
    env.pop("PYTHONPATH")
    alone = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr[-2000:]
    if not _installed("kernels"):
        assert alone.stdout.split() == ["None", "None", "duet.kernels"]


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# Scripts the package ships to run in another program's environment, never imported by duet.
PEER_SCRIPTS = {"benchmarks/vllm_peer.py", "benchmarks/vllm_client.py"}  # run in vLLM's own venv (its offline engine; its bench client)
# Imported only where its absence is handled: `duet bench grammar` then measures llguidance alone;
# `duet bench offline --lora` says to install the test extras (PEFT writes its adapters).
OPTIONAL_IMPORTS = {"xgrammar": {"benchmarks/grammar.py"}, "peft": {"benchmarks/lora.py"}}


def test_every_third_party_import_is_a_declared_dependency():
    """`pip install -e .` (no extras) is README's first command: a module the package imports but
    only an extra installs (httpx once was) breaks `duet up` on a fresh machine."""
    import ast
    import re
    import tomllib

    root = Path(__file__).resolve().parents[1]
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    declared = {_normalize(re.split(r"[<>=!~\[; ]", requirement, 1)[0]) for requirement in pyproject["project"]["dependencies"]}
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for folder in pyproject["tool"]["setuptools"]["package-dir"].values():
        for path in (root / folder).rglob("*.py"):
            if str(path.relative_to(root)) in PEER_SCRIPTS:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top == "duet":
                        continue
                    if str(path.relative_to(root)) in OPTIONAL_IMPORTS.get(top, ()):
                        continue
                    owners = {_normalize(dist) for dist in distributions.get(top, [top])}
                    if not owners & declared:
                        missing.setdefault(top, set()).add(str(path.relative_to(root)))
    assert not missing, f"imported but not in [project].dependencies: {missing}"


def _normalize(name: str) -> str:
    return name.lower().replace("_", "-")
