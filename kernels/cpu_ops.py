"""The C++ CPU kernels, compiled for this machine at first use: ``load()`` gives those of
``csrc/cpu_ops.cpp`` (attention, norms, activations) and the decoder stack of
``csrc/decoder_stack.cpp`` (a model's layers in one call), ``load_gguf()`` the matmuls over GGUF
weight blocks of ``csrc/gguf_ops.cpp`` (built apart: without -ffast-math, so that nothing
reassociates their dequantization; registered as torch operators too, for the decoder stack).

Each build takes about a minute once per machine (torch caches it under
``$TORCH_EXTENSIONS_DIR``). Where no compiler works, or with ``DUET_CPU_OPS=0``, both return
None and callers use the torch implementations (and the dequantized float weights).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = Path(__file__).parent / "csrc"
STALE_LOCK_S = 900.0  # a build lock older than this was left by a build that died


@functools.cache
def load():
    """The attention, norm and activation kernels, or None when they cannot be built or are switched off."""
    # -ffast-math at compile time only lets gcc vectorise expf through libmvec; it is not
    # passed to the linker, so no flush-to-zero mode leaks into the process. The kernels
    # never produce or consume infinities (softmax subtracts the max of visible scores).
    return _build("duet_cpu_ops", ["cpu_ops.cpp", "decoder_stack.cpp"], ["-ffast-math"], ["-lmvec"])


@functools.cache
def load_gguf():
    """The GGUF block matmuls (fp32, and bf16 where the CPU has AVX512_BF16: ``has_bf16()``), or
    None when they cannot be built or are switched off."""
    return _build("duet_gguf_ops", ["gguf_ops.cpp", "gguf_bf16.cpp"], [], [])


def _build(name: str, sources: list[str], cflags: list[str], ldflags: list[str]):
    if os.environ.get("DUET_CPU_OPS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        _clear_stale_lock(name)
        if not _is_built(name):
            logger.info("compiling duet's C++ CPU kernels (%s) for this machine (once, about a minute)", ", ".join(sources))
        return load_extension(
            name=name,
            sources=[str(_SOURCES / source) for source in sources],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *cflags, f"-DDUET_HEADERS={_headers_digest()}"],
            extra_ldflags=["-fopenmp", *ldflags],
            verbose=False,
        )
    except Exception as error:  # any build failure leaves the torch path working
        logger.warning("C++ CPU kernels %s unavailable (%s); using the slower torch implementations", ", ".join(sources), error)
        return None


def _headers_digest() -> str:
    """A digest of ``csrc``'s headers, passed as a define: torch rebuilds an extension when its
    sources or flags change, and knows nothing of the headers they include."""
    digest = hashlib.sha256()
    for header in sorted(_SOURCES.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def _clear_stale_lock(name: str) -> None:
    """Remove a build lock older than ``STALE_LOCK_S``. torch's extension build holds a lock
    file while it compiles and waits, without limit, for any lock it finds: one left behind by
    a build that was killed (a ``duet up`` interrupted on a fresh machine) would hang every later
    load. A build takes about a minute; a lock this old has no build behind it."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(name, verbose=False)) / "lock"
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            logger.warning("removing %s, left by a build that did not finish", lock)
            lock.unlink(missing_ok=True)
    except FileNotFoundError:
        pass  # no lock: nothing to clear
    except Exception as error:  # noqa: BLE001 - a private helper; the build goes on as before
        logger.debug("could not check the build lock of %s: %r", name, error)


def _is_built(name: str) -> bool:
    """Whether torch's extension cache already holds a build (only to say when one starts)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:  # noqa: BLE001 - a private helper; not knowing only costs a log line
        return True
