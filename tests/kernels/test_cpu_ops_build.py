"""Building the C++ kernels: a lock left by a build that died does not hang later loads, and a
build is loaded again as it is wherever its inputs are the same."""

from __future__ import annotations

import os
import time

import pytest
import torch.utils.cpp_extension as cpp_extension

from duet.kernels import cpu_ops


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = tmp_path / "duet_lock_check"
    build.mkdir()
    lock = build / "lock"
    lock.touch()
    cpu_ops._clear_stale_lock("duet_lock_check")
    assert lock.exists()  # a build may be compiling right now
    old = time.time() - cpu_ops.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    cpu_ops._clear_stale_lock("duet_lock_check")
    assert not lock.exists()
    cpu_ops._clear_stale_lock("duet_lock_check")  # none left: nothing to do


PROBE = """#include <pybind11/pybind11.h>
int answer() { return ANSWER; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""


@pytest.mark.slow  # compiles a small extension
def test_a_build_whose_inputs_are_the_same_is_loaded_without_torchs_loader(tmp_path, monkeypatch):
    """Guards a second compile of every kernel in CI: torch's loader runs ninja, whose compiler
    command names this environment's torch headers, so README's environment and the tests' (the
    same torch, sources and machine) each compiled the kernels. A build whose stamp matches its
    inputs is imported as it is; a changed input goes to torch's loader again."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    sources = tmp_path / "csrc"
    sources.mkdir()
    (sources / "probe.cpp").write_text(PROBE)
    monkeypatch.setattr(cpu_ops, "_SOURCES", sources)
    loads = []
    real_load = cpp_extension.load
    monkeypatch.setattr(cpp_extension, "load", lambda *args, **kwargs: loads.append(kwargs["name"]) or real_load(*args, **kwargs))

    assert cpu_ops._build("duet_probe", ["probe.cpp"], ["-DANSWER=42"], []).answer() == 42
    assert loads == ["duet_probe"] and (tmp_path / "cache" / "duet_probe" / "duet-build-stamp").exists()
    again = cpu_ops._build("duet_probe", ["probe.cpp"], ["-DANSWER=42"], [])
    assert again.answer() == 42 and loads == ["duet_probe"]  # no loader, no ninja
    assert cpu_ops._build("duet_probe", ["probe.cpp"], ["-DANSWER=43"], []).answer() == 43
    assert loads == ["duet_probe", "duet_probe"]
