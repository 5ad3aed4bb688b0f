"""The C++ CPU kernels of ``csrc/cpu_ops.cpp``, compiled for this machine at first use.

The build takes about a minute once per machine (torch caches it under
``$TORCH_EXTENSIONS_DIR``). Where no compiler works, or with ``DUET_CPU_OPS=0``,
``load()`` returns None and callers use the torch implementations.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"


@functools.cache
def load():
    """The compiled module, or None when it cannot be built or is switched off."""
    if os.environ.get("DUET_CPU_OPS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        if not _is_built():
            logger.info("compiling duet's C++ CPU kernels for this machine (once, about a minute)")

        # -ffast-math at compile time only lets gcc vectorise expf through libmvec; it is not
        # passed to the linker, so no flush-to-zero mode leaks into the process. The kernels
        # never produce or consume infinities (softmax subtracts the max of visible scores).
        return load_extension(
            name="duet_cpu_ops",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
            extra_ldflags=["-fopenmp", "-lmvec"],
            verbose=False,
        )
    except Exception as error:  # any build failure leaves the torch path working
        logger.warning("C++ CPU kernels unavailable (%s); using the slower torch implementations", error)
        return None


def _is_built() -> bool:
    """Whether torch's extension cache already holds a build (only to say when one starts)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory("duet_cpu_ops", verbose=False)) / "duet_cpu_ops.so").exists()
    except Exception:  # noqa: BLE001 - a private helper; not knowing only costs a log line
        return True
