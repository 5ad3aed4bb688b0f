"""The C++ CPU kernels, compiled for this machine at first use: ``load()`` gives those of
``csrc/cpu_ops.cpp`` (norms, activations, the bindings), ``csrc/paged_attention.cpp`` and
``csrc/prompt_attention.cpp`` (attention), the decoder stack of
``csrc/decoder_stack.cpp`` (a model's layers in one call), the LoRA updates of
``csrc/lora.cpp`` and the KV transfer's block copies of ``csrc/block_copy.cpp``, ``load_gguf()`` the matmuls over GGUF
weight blocks of ``csrc/gguf_ops.cpp``, the batch-invariant products of
``csrc/batch_invariant.cpp`` and W8A8's of ``csrc/int8_rows.cpp`` (built apart: without -ffast-math, so that nothing reassociates
their dequantization or their sums; registered as torch operators too, for the decoder stack).

Each build takes one to three minutes once per machine (torch caches it under
``$TORCH_EXTENSIONS_DIR``; another environment with the same torch, Python and sources loads
it as it is: ``_build_stamp``). Where no compiler works, or with ``DUET_CPU_OPS=0``, both return
None and callers use the torch implementations (and the dequantized float weights).

The rules timed at first use (which way products of so many rows go) are measured once per
machine and thread count, or given by ``DUET_CPU_RULES`` (``cpu_rules``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

from duet.kernels.cpu_rules import rule
from duet.kernels.gguf import Q4_1

logger = logging.getLogger(__name__)

_SOURCES = Path(__file__).parent / "csrc"
STALE_LOCK_S = 900.0  # a build lock older than this was left by a build that died


@functools.cache
def load():
    """The attention, norm and activation kernels, or None when they cannot be built or are switched off."""
    # -ffast-math at compile time only lets gcc vectorise expf through libmvec; it is not
    # passed to the linker, so no flush-to-zero mode leaks into the process. The kernels
    # never produce or consume infinities (softmax subtracts the max of visible scores).
    return _build("duet_cpu_ops", ["cpu_ops.cpp", "paged_attention.cpp", "prompt_attention.cpp", "decoder_stack.cpp", "lora.cpp", "block_copy.cpp"], ["-ffast-math"], ["-lmvec"])


@functools.cache
def load_gguf():
    """The GGUF block matmuls (fp32, and bf16 where the CPU has AVX512_BF16: ``has_bf16()``) and
    the float weights' panel products (``invariant_linear``), or None when they cannot be built or
    are switched off. GGUF products of many rows go by panels or by tiles of rows as this CPU
    measured faster (``panel_min_rows``, once per machine: ``cpu_rules``)."""
    ops = _build("duet_gguf_ops", ["gguf_ops.cpp", "gguf_argmax.cpp", "gguf_bf16.cpp", "batch_invariant.cpp", "int8_rows.cpp"], [], [])
    if ops is not None:
        ops.set_panel_min_rows(rule("gguf_panel_min_rows", lambda: panel_min_rows(ops)))
        if ops.has_bf16():
            ops.set_bf16_panel_min_rows(rule("gguf_bf16_panel_min_rows", lambda: panel_min_rows(ops, torch.bfloat16)))
        if ops.has_amx():
            ops.set_bf16_amx_min_rows(rule("gguf_bf16_amx_min_rows", lambda: amx_min_rows(ops)))
    return ops


# Row counts at which the GGUF products' two ways for many rows are timed, and the margin by
# which panels must beat tiles of rows to take over (a noisy tie leaves the rule where it is).
# 10: bf16 panels tie tiles at 8 rows over the sample weights and win by 1.2x at 12, where
# SmolLM2's bf16 products took 17.8 ms by tiles and 12.6 by panels at 10 (a 2-core EPYC Zen 4).
PANEL_ROWS = (4, 8, 10, 12, 16, 24, 32, 48, 64)
PANEL_MARGIN = 1.1
NEVER = 1 << 30  # a row count no product reaches


def panel_min_rows(ops, dtype: torch.dtype = torch.float32) -> int:
    """The fewest rows (of ``dtype``: fp32, or bf16 on CPUs with AVX512_BF16) from which the GGUF
    products go by panels of dequantized features rather than by tiles of rows
    (``csrc/gguf_ops.cpp``, ``csrc/gguf_bf16.cpp``): the first of ``PANEL_ROWS`` from which panels
    are ``PANEL_MARGIN`` times faster at every count measured, or never. Timed over
    ``SAMPLE_WEIGHTS`` Q4_1 weights of a SmolLM2 MLP's two shapes (``_first_rows_that_win``),
    with their panel layout where the panels read one: 48 MB, read from memory as a step reads a
    model's (in cache they measured fp32 panels faster from 8 rows where a SmolLM2 step had them
    faster from 16). Best of 3
    interleaved rounds each way, about 0.2 s once per machine (``cpu_rules``). A Xeon measured
    fp32 panels faster from 13 rows (AVX-512, before the panel layout) and a Zen 4 from 8 (AVX2)."""
    bf16 = dtype == torch.bfloat16
    if bf16 and not ops.panels_need_layout():
        return NEVER  # bf16 panels read the panel layout alone
    product = ops.gguf_matmul_bf16 if bf16 else ops.gguf_matmul
    chosen = _first_rows_that_win(
        lambda weight, x: product(x, *weight[:3], NEVER, *weight[3:]), lambda weight, x: product(x, *weight[:3], 1, *weight[3:]),
        dtype, with_layout=ops.panels_need_layout(), ops=ops,
    )
    way = "tiles of rows" if chosen == NEVER else f"panels from {chosen} rows"
    logger.info("GGUF products of many %s rows go by %s on this CPU", "bf16" if bf16 else "fp32", way)
    return chosen


def amx_min_rows(ops) -> int:
    """The fewest bf16 rows from which the GGUF products go by panels on AMX tiles rather than
    as the process's rule for vdpbf16ps has them (tiles of rows or panels,
    ``csrc/gguf_bf16.cpp``), on CPUs with AMX-BF16: timed as ``panel_min_rows`` is. On a 2-core
    Xeon with AMX, over those weights by panels both ways: 2.25 ms by vdpbf16ps against 2.31 on
    AMX at 4 rows, 3.23 against 2.15 at 8, 10.1 against 3.35 at 32."""

    def product(amx_rows: int):
        def run(weight, x):
            ops.set_bf16_amx_min_rows(amx_rows)
            ops.gguf_matmul_bf16(x, *weight[:3], -1, *weight[3:])
        return run

    try:
        chosen = _first_rows_that_win(product(NEVER), product(1), torch.bfloat16, with_layout=True, ops=ops)
    finally:
        ops.set_bf16_amx_min_rows(NEVER)
    logger.info("GGUF products of many bf16 rows go by %s on this CPU", "vdpbf16ps" if chosen == NEVER else f"AMX tiles from {chosen} rows")
    return chosen


def _first_rows_that_win(old, new, dtype: torch.dtype, with_layout: bool, ops) -> int:
    """The first of ``PANEL_ROWS`` from which ``new(weight, x)`` is ``PANEL_MARGIN`` times
    faster than ``old(weight, x)`` at every count measured, or ``NEVER``: over ``SAMPLE_WEIGHTS``
    Q4_1 weights in an MLP's two shapes, half of them up (``SAMPLE_OUT_FEATURES`` x
    ``SAMPLE_IN_FEATURES``) and half down (the transpose: a longer reduction, which favours the
    panels), each ``(codes, scales, Q4_1, panel codes, panel scales)`` (the layout where
    ``with_layout``), rows of ``dtype``, best of 3 interleaved rounds each way. Timed over the up
    shape alone, a 2-core EPYC Zen 4 measured panels 1.09-1.15x faster at 8 rows, which the
    margin left to tiles, where SmolLM2's products took 20.4 ms by tiles and 16.3 by panels."""
    shapes = ((SAMPLE_OUT_FEATURES, SAMPLE_IN_FEATURES), (SAMPLE_IN_FEATURES, SAMPLE_OUT_FEATURES))
    weights = []
    for seed, (out_features, in_features) in enumerate(shapes):
        for codes, scales in sample_q4_1_weights(SAMPLE_WEIGHTS // 2, out_features, in_features, seed=seed):
            layout = ops.gguf_panel_layout(codes, scales, Q4_1, in_features) if with_layout else (None, None)
            weights.append(((codes, scales, Q4_1, *layout), in_features))
    generator = torch.Generator().manual_seed(1)
    wins = []
    for rows in PANEL_ROWS:
        xs = {in_features: torch.randn(rows, in_features, generator=generator).to(dtype) for _, in_features in shapes}
        ways = {
            name: (lambda way=way: [way(weight, xs[in_features]) for weight, in_features in weights])
            for name, way in (("old", old), ("new", new))
        }
        times = best_times(ways, rounds=3)
        wins.append(times["old"] >= PANEL_MARGIN * times["new"])
    chosen = NEVER
    for rows, win in zip(reversed(PANEL_ROWS), reversed(wins)):
        if not win:
            break
        chosen = rows
    return chosen


SAMPLE_OUT_FEATURES, SAMPLE_IN_FEATURES = 1536, 576  # a SmolLM2 MLP's up projection
SAMPLE_WEIGHTS = 36  # of that shape: 127 MB of fp32 weights, 24 MB of Q4_1 blocks


def sample_q4_1_weights(
    count: int = 1, out_features: int = SAMPLE_OUT_FEATURES, in_features: int = SAMPLE_IN_FEATURES, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` Q4_1 weights of random codes and scales, each ``(codes, scales)`` as
    ``GGUFWeight`` keeps them and in memory of its own, to time products on."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = in_features // 32
    codes = torch.randint(0, 256, (count, out_features, num_blocks * 16), dtype=torch.uint8, generator=generator)
    scales = torch.rand(count, out_features, num_blocks * 2, generator=generator) * 0.01
    return list(zip(codes.unbind(), scales.unbind()))


def best_times(ways: dict, rounds: int = 5, calls: int = 1) -> dict[str, float]:
    """Each way's best time (seconds) for ``calls`` calls, over ``rounds`` rounds that take the
    ways in turn, so that a machine's slow moment falls on all of them alike."""
    best = {name: float("inf") for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            started = time.perf_counter()
            for _ in range(calls):
                way()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def _build(name: str, sources: list[str], cflags: list[str], ldflags: list[str]):
    if os.environ.get("DUET_CPU_OPS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        paths = [_SOURCES / source for source in sources]
        extra_cflags = ["-O3", "-march=native", "-fopenmp", *cflags, f"-DDUET_HEADERS={_headers_digest()}"]
        extra_ldflags = ["-fopenmp", *ldflags]
        stamp = _build_stamp(paths, extra_cflags, extra_ldflags)
        built = _load_built(name, stamp)
        if built is not None:
            return built
        _clear_stale_lock(name)
        if not _is_built(name):
            logger.info("compiling duet's C++ CPU kernels (%s) for this machine (once, about a minute)", ", ".join(sources))
        _stamp_path(name).unlink(missing_ok=True)  # no other process takes this build as it is while it changes
        module = load_extension(
            name=name, sources=[str(path) for path in paths], extra_cflags=extra_cflags, extra_ldflags=extra_ldflags, verbose=False
        )
        _write_stamp(name, module, stamp)
        return module
    except Exception as error:  # any build failure leaves the torch path working
        logger.warning("C++ CPU kernels %s unavailable (%s); using the slower torch implementations", ", ".join(sources), error)
        return None


def _build_stamp(paths: list[Path], cflags: list[str], ldflags: list[str]) -> str:
    """What a build is made of, but for where its environment lies: torch's version, Python's,
    the CPU's features (``-march=native``), the flags and the sources (the headers are in the
    flags). torch's loader rebuilds whenever its compiler command changes, and that command
    names the environment's torch headers: a second environment compiled the same kernels again."""
    digest = hashlib.sha256()
    for part in (torch.__version__, sys.version, platform.machine(), _cpu_features(), *cflags, "|", *ldflags):
        digest.update(part.encode() + b"\0")
    for path in paths:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _stamp_path(name: str) -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False)) / "duet-build-stamp"


def _load_built(name: str, stamp: str):
    """The build in torch's cache, imported as it is, when its stamp is ``stamp``; else None."""
    try:
        path = _stamp_path(name)
        library = path.with_name(f"{name}.so")
        if path.read_text() != stamp or not library.exists():
            return None
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except FileNotFoundError:
        return None
    except Exception as error:  # noqa: BLE001 - torch's loader builds it again
        logger.warning("could not load the built %s as it is (%r); building it", name, error)
        return None


def _write_stamp(name: str, module, stamp: str) -> None:
    """Stamp the build torch just loaded, if it is the one ``_load_built`` reads (a process
    whose sources changed under it builds ``name_v1`` and so on)."""
    path = _stamp_path(name)
    if Path(module.__file__).resolve() != path.with_name(f"{name}.so").resolve():
        return
    partial = path.with_name(f"{path.name}.{os.getpid()}")
    partial.write_text(stamp)
    partial.replace(path)


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
