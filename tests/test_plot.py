"""The picture of a quota: ``throttle_client.plot`` and ``demo --plot``. What is drawn is
read back from the matplotlib Figure: a panel per key and rate, each line's points,
the limit line, the shaded pauses; and ``demo --plot`` draws its own run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Polygon, Rectangle

import throttle_client.plot
from throttle_client import Rate
from throttle_client.cli import demo
from throttle_client.cli.command import main
from throttle_client.cli.demo import fullest_window
from throttle_client.plot import plot_quota, quota_figure, window_counts

PNG = b"\x89PNG\r\n\x1a\n"
RATES = [Rate.parse("10/second"), Rate.parse("25/5 seconds")]


def test_window_counts_rise_with_arrivals_and_fall_a_period_later() -> None:
    moments, counts = window_counts([0.0, 0.5, 1.2], period=1.0)
    assert list(zip(moments, counts, strict=True)) == [
        (0.0, 1),
        (0.5, 2),
        (1.0, 1),  # 0.0 leaves the window (t - 1, t]
        (1.2, 2),
        (1.5, 1),
        (2.2, 0),
    ]


# -- reading a Figure back ----------------------------------------------------------------


def panels(figure: Figure) -> dict[str, Axes]:
    """The figure's panels by title ("token 1: 10/1s")."""
    titled = {ax.get_title(): ax for ax in figure.axes}
    assert len(titled) == len(figure.axes)  # no two panels alike
    return titled


def line(ax: Axes, label: str) -> Line2D:
    (found,) = [drawn for drawn in ax.get_lines() if drawn.get_label() == label]
    return found


def steps(ax: Axes, label: str) -> list[tuple[float, int]]:
    """The points of the step line ``label``, drawn as steps that hold until the next."""
    drawn = line(ax, label)
    assert drawn.get_drawstyle() == "steps-post"
    xs, ys = drawn.get_xdata(), drawn.get_ydata()
    return [(float(x), int(y)) for x, y in zip(xs, ys, strict=True)]  # type: ignore[arg-type]


def expected_steps(times: Sequence[float], period: float) -> list[tuple[float, int]]:
    """The window counts of ``times``, from the first of them."""
    moments, counts = window_counts(times, period)
    return [(m - min(times), n) for m, n in zip(moments, counts, strict=True)]


def shaded(ax: Axes) -> list[tuple[float, float]]:
    """The x extents of the panel's shaded spans (a Rectangle, or before matplotlib 3.9 a
    Polygon)."""
    spans = []
    for patch in ax.patches:
        if isinstance(patch, Rectangle):
            spans.append((patch.get_x(), patch.get_x() + patch.get_width()))
        else:
            assert isinstance(patch, Polygon)
            xs = [float(x) for x, _ in patch.get_xy()]
            spans.append((min(xs), max(xs)))
    return spans


def grid_place(ax: Axes) -> tuple[int, int, int, int]:
    """(rows, columns, row, column) of the panel in its figure's grid."""
    spec = ax.get_subplotspec()
    assert spec is not None
    rows, columns = spec.get_geometry()[:2]
    return rows, columns, spec.rowspan.start, spec.colspan.start


def title(rate: Rate) -> str:
    return f"{rate.limit}/{rate.period:g}s"


# -- the picture ----------------------------------------------------------------------------


SLOTS = {
    "token 2": [5000 + 0.5 * i for i in range(10)],  # one every 0.5 s: 2 in any second
    "token 1": [1000 + 0.1 * i for i in range(25)],  # 10 in each of the first two seconds
}
# Token 1's requests arrive 10 ms after their slots, but the first, 150 ms: it arrives in
# the same second as the ten after it. (Token 2's arrivals were not recorded.)
ARRIVALS = {"token 1": [t + (0.15 if t == 1000 else 0.01) for t in SLOTS["token 1"]]}
PAUSES = {"token 2": [(5001.0, 5002.5)]}


def test_each_key_and_rate_gets_its_panel_keys_in_rows_rates_in_columns() -> None:
    figure = quota_figure(RATES, SLOTS, arrivals=ARRIVALS, pauses=PAUSES)
    assert [ax.get_title() for ax in figure.axes] == [
        "token 1: 10/1s",
        "token 1: 25/5s",
        "token 2: 10/1s",
        "token 2: 25/5s",
    ]
    # One grid of two rows (keys) by two columns (rates).
    assert [grid_place(ax) for ax in figure.axes] == [
        (2, 2, 0, 0),
        (2, 2, 0, 1),
        (2, 2, 1, 0),
        (2, 2, 1, 1),
    ]


def test_the_limit_line_lies_at_each_rate_s_limit_across_the_panel() -> None:
    figure = panels(quota_figure(RATES, SLOTS, arrivals=ARRIVALS))
    for key in SLOTS:
        for rate in RATES:
            ax = figure[f"{key}: {title(rate)}"]
            limit = line(ax, f"limit {rate.limit}")
            assert list(limit.get_ydata()) == [rate.limit, rate.limit]  # type: ignore[arg-type]
            assert list(limit.get_xdata()) == [0, 1]  # type: ignore[arg-type]  # (axes width)
            low, high = ax.get_ylim()
            assert low == 0 and high > rate.limit  # a window over the limit would show


def test_the_lines_count_the_slots_and_arrivals_given_in_each_rate_s_window() -> None:
    figure = panels(quota_figure(RATES, SLOTS, arrivals=ARRIVALS))
    one_second = figure["token 1: 10/1s"]
    by_slot = steps(one_second, "by slot")
    # Counted by hand: the slots 0.1 s apart fill the one-second window to its limit.
    assert by_slot[:3] == [(0.0, 1), (pytest.approx(0.1), 2), (pytest.approx(0.2), 3)]
    assert max(n for _, n in by_slot) == 10 and by_slot[-1][1] == 0
    assert max(n for _, n in steps(figure["token 2: 10/1s"], "by slot")) == 2
    assert max(n for _, n in steps(figure["token 1: 25/5s"], "by slot")) == 25
    # By arrival, the late first request and the next ten share a second: 11 drawn.
    by_arrival = steps(one_second, "by arrival")
    assert by_arrival[:2] == [(0.0, 1), (pytest.approx(0.04), 2)]  # 1000.11 after 1000.15
    assert max(n for _, n in by_arrival) == 11
    for key, times in SLOTS.items():
        for rate in RATES:
            ax = figure[f"{key}: {title(rate)}"]
            assert steps(ax, "by slot") == expected_steps(times, rate.period)
            if key in ARRIVALS:
                expected = expected_steps(ARRIVALS[key], rate.period)
                assert steps(ax, "by arrival") == expected
            else:  # no arrivals given: no line for them
                assert [d.get_label() for d in ax.get_lines()] == ["by slot", f"limit {rate.limit}"]


def test_a_pause_is_shaded_where_it_lies_from_the_key_s_first_slot() -> None:
    figure = panels(quota_figure(RATES, SLOTS, arrivals=ARRIVALS, pauses=PAUSES))
    for rate in RATES:
        assert shaded(figure[f"token 2: {title(rate)}"]) == [(1.0, 2.5)]
        assert shaded(figure[f"token 1: {title(rate)}"]) == []


def test_plot_quota_saves_that_picture_and_returns_the_fullest_window_drawn(
    tmp_path: Path,
) -> None:
    path = tmp_path / "quota.png"
    peaks = plot_quota(path, RATES, SLOTS, ARRIVALS, PAUSES, title="two tokens")
    assert path.read_bytes()[:8] == PNG
    figure = panels(quota_figure(RATES, SLOTS, arrivals=ARRIVALS, pauses=PAUSES))
    for key in SLOTS:
        for rate in RATES:
            ax = figure[f"{key}: {title(rate)}"]
            names = ["by arrival", "by slot"] if key in ARRIVALS else ["by slot"]
            drawn = {f"{title(rate)} {name}": max(n for _, n in steps(ax, name)) for name in names}
            assert {k: v for k, v in peaks[key].items() if k.startswith(title(rate))} == drawn
            assert peaks[key][f"{title(rate)} by slot"] == fullest_window(SLOTS[key], rate.period)
    assert peaks["token 1"]["10/1s by arrival"] == 11


def test_plot_quota_refuses_nothing_to_draw(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one rate"):
        plot_quota(tmp_path / "x.png", [], {"k": [1.0]})
    with pytest.raises(ValueError, match="at least one key"):
        plot_quota(tmp_path / "x.png", [Rate.parse("1/second")], {})
    assert not (tmp_path / "x.png").exists()


# -- demo --plot ------------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_plot_draws_the_run_s_own_slots_and_arrivals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[demo.DemoRun] = []
    figures: list[Figure] = []
    run_demo, draw = demo.run_demo, throttle_client.plot.quota_figure

    def keep_run(*args: Any, **kwargs: Any) -> demo.DemoRun:
        runs.append(run_demo(*args, **kwargs))
        return runs[-1]

    def keep_figure(*args: Any, **kwargs: Any) -> Figure:
        figures.append(draw(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(demo, "run_demo", keep_run)
    monkeypatch.setattr(throttle_client.plot, "quota_figure", keep_figure)
    path = tmp_path / "demo.png"
    args = ["--duration", "3", "--workers", "2", "--tokens", "2", "--json", "--plot", str(path)]
    status = main(["demo", *args])
    summary = json.loads(capsys.readouterr().out)
    # The picture is the point here, not the verdict: a stall of a busy machine longer
    # than the margin can earn one 429, and the picture must show that run all the same.
    assert summary["errors"] == [] and status == (summary["rejected"] > 0), summary
    assert path.read_bytes()[:8] == PNG
    (run,), (figure,) = runs, figures
    drawn = panels(figure)
    rates = run.config.rates
    assert len(drawn) == 2 * len(rates)
    arrivals = run.upstream_stats["arrivals"]
    for number, token in enumerate(run.tokens):
        slots, arrived = run.slots[number], arrivals[token]
        assert len(slots) >= 10 and len(arrived) >= 10  # the run's own requests
        for rate in rates:
            ax = drawn[f"token {number + 1}: {title(rate)}"]
            assert steps(ax, "by slot") == expected_steps(slots, rate.period)
            assert steps(ax, "by arrival") == expected_steps(arrived, rate.period)
            assert list(line(ax, f"limit {rate.limit}").get_ydata()) == [rate.limit] * 2  # type: ignore[arg-type]
    # What the summary says of the run is what the picture shows.
    for rate in rates:
        peak = summary["peak_in_window"][str(rate)]
        for series, measured in [("by slot", "by_slot"), ("by arrival", "by_arrival")]:
            highest = max(
                max(n for _, n in steps(drawn[f"token {k + 1}: {title(rate)}"], series))
                for k in range(2)
            )
            assert highest == peak[measured]


@pytest.mark.parametrize(
    ("name", "message"),
    [("quota.gif", "must end in .png, .svg or .pdf"), ("nowhere/quota.png", "no such directory")],
)
def test_demo_plot_refuses_a_picture_it_could_not_draw_before_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, message: str
) -> None:
    assert main(["demo", "--duration", "3", "--plot", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert message in err and name in err and len(err.splitlines()) == 1
