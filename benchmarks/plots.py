"""The one matplotlib prologue and epilogue the benchmarks' plots share.

    with saved_figure(path, figsize=(9, 4)) as (figure, axes):
        axes.bar(...)

draws on a fresh figure (headless: the Agg backend), then lays it out, writes the PNG to
``path``, closes the figure and prints ``plot written to <path>``. Keyword arguments other
than the ones named go to ``plt.subplots`` (``nrows``, ``ncols``, ``sharex``, ``gridspec_kw``...),
so ``axes`` is whatever it returns: one axis, or an array of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def saved_figure(path: str, *, figsize: tuple[float, float], dpi: int = 120, what: str = "plot", **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """A figure of ``figsize`` inches to draw on, saved to ``path`` at ``dpi`` on leaving the block.

    ``what`` names it in the line printed once it is written (``timeline written to ...``).
    Nothing is written or printed if the block raises; the figure is closed either way.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=figsize, **subplots)
    try:
        yield figure, axes
        figure.tight_layout()
        figure.savefig(path, dpi=dpi)
    finally:
        plt.close(figure)
    print(f"{what} written to {path}")
