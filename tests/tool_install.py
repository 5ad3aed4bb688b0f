"""Writers of checkpoints in formats that duet's pinned packages no longer write (or whose
versions want another torch), installed once, without their dependencies, into a folder of the
test cache and run in a child process whose path starts there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def tools_dir(name: str, packages: tuple[str, ...]) -> Path:
    """The folder ``packages`` are installed in, as ``name`` (installed on first use, and again
    when the list changes)."""
    cache = Path(os.environ.get("DUET_CACHE_DIR", Path.home() / ".cache" / "duet"))
    target = cache / "test-tools" / name
    if not (target / ".complete").exists() or (target / ".complete").read_text() != "\n".join(packages):
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade", "--target", str(target), *packages], check=True,
            timeout=900,
        )
        (target / ".complete").write_text("\n".join(packages))
    return target
