"""The benchmarks' shared plot helper writes a PNG, says where, and closes its figure."""

import pytest

from duet.benchmarks.plots import saved_figure

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_saved_figure_writes_a_png_and_reports_it(tmp_path, capsys):
    import matplotlib.pyplot as plt

    path = tmp_path / "plot.png"
    with saved_figure(str(path), figsize=(3, 2), dpi=50, what="timeline", ncols=2, sharex=True) as (figure, axes):
        assert len(axes) == 2
        axes[0].plot([0, 1], [1, 0])
        number = figure.number
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    width, height = figure.get_size_inches()
    assert (width, height) == (3, 2)
    assert capsys.readouterr().out == f"timeline written to {path}\n"
    assert not plt.fignum_exists(number)


def test_saved_figure_writes_nothing_when_drawing_fails(tmp_path, capsys):
    import matplotlib.pyplot as plt

    path = tmp_path / "plot.png"
    with pytest.raises(RuntimeError), saved_figure(str(path), figsize=(3, 2)) as (figure, axes):
        number = figure.number
        raise RuntimeError("drawing failed")
    assert not path.exists()
    assert capsys.readouterr().out == ""
    assert not plt.fignum_exists(number)
