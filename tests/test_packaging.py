"""Our folder names must never shadow other distributions' packages.

``kernels`` is a Hugging Face package that transformers probes for; if ``import kernels``
found ours, transformers would take it for the hub-kernels library and fail on import.
"""

import importlib.metadata
import subprocess
import sys
from pathlib import Path


def test_installed_distribution_owns_only_the_duet_namespace():
    distributions = importlib.metadata.packages_distributions()
    owned = sorted(name for name, dists in distributions.items() if "duet" in dists)
    assert owned == ["duet"], f"duet installs top-level packages {owned}; everything must live under duet."


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
    try:
        importlib.metadata.distribution("kernels")
        hf_kernels_installed = True
    except importlib.metadata.PackageNotFoundError:
        hf_kernels_installed = False
    assert result.stdout.strip().splitlines()[-1] == str(hf_kernels_installed)
