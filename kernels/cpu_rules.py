"""The CPU rules: which way products of so many rows go on this CPU (``cpu_ops.panel_min_rows``,
``linear_rules.float_panel_rows``, ``w8a8.int8_min_rows``, ...), each timed by the first process that
needs it. ``rule(name, measure)`` gives a rule's value from, in order:

1. ``DUET_CPU_RULES``: JSON of a rule's name to its value, given by the process that started
   this one (the tests' session hands its rules to Ray's processes that way);
2. this machine's rules file: what an earlier process measured on the same CPU (its model and
   features), with the same sources, torch and thread count (``rules_file``), under
   ``DUET_CPU_RULES_CACHE`` (a folder; ``off``: none is read or written) or
   ``~/.cache/duet/cpu-rules``;
3. the measurement itself, whose value then goes to that file for the processes after.

A replica that a pool adds under load thus skips seconds of timing, and times nothing while
other replicas hold the cores (which also skews what it measures): on a 2-core Xeon a SmolLM2
fp32 engine was built in 4.3-4.4 s against 7.6-8.4 timing its rules on an idle machine, in
12.9-13.3 s against 35.1-45.3 beside two busy processes. A rule that two ways tie on may come
out either way from one measurement to the next (as it may per process); delete the folder to
have the rules measured again.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

RULES_ENV = "DUET_CPU_RULES"
CACHE_ENV = "DUET_CPU_RULES_CACHE"
_DIR = Path(__file__).resolve().parent
# What the measurements are made of: the kernels and the Python that times them.
_SOURCES = ("cpu_ops.py", "w8a8.py", "cascade.py", "csrc")
_MODULES = ("duet.models.linear_rules",)


def pinned_rule(name: str) -> int | None:
    """The value ``DUET_CPU_RULES`` gives the rule ``name``; None where it gives none."""
    value = json.loads(os.environ.get(RULES_ENV) or "{}").get(name)
    return None if value is None else int(value)


def rule(name: str, measure: Callable[[], int]) -> int:
    """The rule ``name``: given by ``DUET_CPU_RULES``, else as this machine measured it before,
    else ``measure()`` (then kept in the rules file)."""
    if (pinned := pinned_rule(name)) is not None:
        return pinned
    return int(remembered(name, measure))


def remembered(name: str, measure: Callable[[], Any]) -> Any:
    """A measurement of this machine's (any JSON value) as an earlier process made it, else
    ``measure()``'s, then kept in the rules file."""
    path = rules_file()
    if path is not None and (known := _read(path).get(name)) is not None:
        return known
    value = measure()
    if path is not None:
        _keep(path, name, value)
    return value


def rules_file() -> Path | None:
    """This machine's rules file for this process (its CPU, the sources, torch, Python and its
    thread count), or None where ``DUET_CPU_RULES_CACHE`` is ``off``."""
    folder = os.environ.get(CACHE_ENV, "")
    if folder.lower() == "off":
        return None
    root = Path(folder) if folder else Path.home() / ".cache" / "duet" / "cpu-rules"
    digest = hashlib.sha256()
    for part in (_cpu(), torch.__version__, sys.version, str(torch.get_num_threads()), _sources_digest()):
        digest.update(part.encode() + b"\0")
    return root / f"{digest.hexdigest()[:24]}.json"


def _read(path: Path) -> dict:
    try:
        rules = json.loads(path.read_text())
        return rules if isinstance(rules, dict) else {}
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measure (and write it whole again)


def _keep(path: Path, name: str, value: Any) -> None:
    """Adds ``name`` to the file, written whole and renamed into place, so that a reader never
    sees half of it (two processes writing at once may each lose the other's new rule, which
    the next process measures again)."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(_read(path) | {name: value}, sort_keys=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
            temporary = out.name
            out.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except (OSError, TypeError, ValueError) as error:  # no room or no right to write; a value JSON cannot hold
        logger.warning("could not keep the CPU rule %s in %s (%s); the next process measures it again", name, path, error)
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)


@functools.cache
def _cpu() -> str:
    """The CPU's model name and features, as /proc/cpuinfo gives them."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


@functools.cache
def _sources_digest() -> str:
    paths = [_DIR / source for source in _SOURCES]
    paths += [Path(spec.origin) for module in _MODULES if (spec := importlib.util.find_spec(module)) and spec.origin]
    digest = hashlib.sha256()
    for path in paths:
        for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
            if file.is_file() and file.suffix in (".py", ".cpp", ".h"):
                digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()
