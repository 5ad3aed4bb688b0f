"""Building the C++ kernels: a lock left by a build that died does not hang later loads."""

from __future__ import annotations

import os
import time

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
