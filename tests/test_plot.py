"""The picture of a quota (issue 12): ``throttle_client.plot`` and ``demo --plot``. The
picture is produced and not blank, and what it draws is what the summary measures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from throttle_client import Rate
from throttle_client.cli.command import main
from throttle_client.cli.demo import fullest_window
from throttle_client.plot import plot_quota, window_counts

PNG = b"\x89PNG\r\n\x1a\n"


def drawn(path: Path) -> float:
    """How much the picture varies (0: a blank one)."""
    assert path.read_bytes()[:8] == PNG
    return float(imread(path).std())


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


def test_the_picture_draws_each_key_and_rate_against_its_limit(tmp_path: Path) -> None:
    rates = [Rate.parse("10/second"), Rate.parse("25/5 seconds")]
    slots = {
        "token 1": [1000 + 0.1 * i for i in range(25)],  # 10 in the first second
        "token 2": [5000 + 0.5 * i for i in range(10)],
    }
    arrivals = {key: [t + 0.01 for t in times] for key, times in slots.items()}
    path = tmp_path / "quota.png"
    peaks = plot_quota(path, rates, slots, arrivals, {"token 2": [(5001.0, 5002.0)]})
    assert path.stat().st_size > 20_000 and drawn(path) > 0.05
    for key, times in slots.items():
        for rate in rates:
            name = f"{rate.limit}/{rate.period:g}s"
            assert peaks[key][f"{name} by slot"] == fullest_window(times, rate.period)
            assert peaks[key][f"{name} by arrival"] == fullest_window(arrivals[key], rate.period)
    assert peaks["token 1"]["10/1s by slot"] == 10
    assert peaks["token 2"]["25/5s by slot"] == 10


def test_plot_quota_refuses_nothing_to_draw(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one rate"):
        plot_quota(tmp_path / "x.png", [], {"k": [1.0]})
    with pytest.raises(ValueError, match="at least one key"):
        plot_quota(tmp_path / "x.png", [Rate.parse("1/second")], {})


@pytest.mark.slow
def test_demo_plot_draws_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "demo.png"
    status = main(["demo", "--duration", "3", "--workers", "2", "--json", "--plot", str(path)])
    summary = json.loads(capsys.readouterr().out)
    assert status == 0, summary
    assert summary["requests"] > 0
    assert path.stat().st_size > 20_000 and drawn(path) > 0.05


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
