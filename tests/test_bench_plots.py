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


def test_the_autoscale_timeline_shows_each_replicas_role_as_it_moves(tmp_path, capsys):
    from duet.benchmarks.autoscale import Sample, plot, role_segments

    roles = [("prefill", "decode"), ("decode", "decode"), ("decode", "decode"), ("prefill", "decode")]
    samples = [
        Sample(float(at), {"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1}, {"p1": ["prefill", first, 1], "d1": ["decode", second, 1]})
        for at, (first, second) in enumerate(roles)
    ]
    segments = role_segments(samples)
    assert segments["prefill p1 (1 thr)"] == [(0.0, 1.0, "prefill"), (1.0, 3.0, "decode")]
    assert segments["decode d1 (1 thr)"] == [(0.0, 3.0, "decode")]
    plot([], samples, {"idle": (0.0, 3.0)}, 1.0, str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").stat().st_size > 0
