"""A picture of a quota: per key and rate, the requests in the rate's sliding
window over time, by arrival (as the upstream counts them) and by slot (as the limiter
booked them), against the limit; pauses shaded. Needs matplotlib (the ``plot`` extra)::

    from throttle_client.plot import plot_quota

    plot_quota("quota.png", limiter.rates, slots={"token 1": [...]}, arrivals={...})

``quota_figure`` gives the same picture as a matplotlib ``Figure``. ``throttle-client
demo --plot quota.png`` draws one from the demo's own run.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from os import PathLike
from typing import TYPE_CHECKING

from ._rate import Rate

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_quota", "quota_figure", "window_counts"]

Times = Mapping[str, Sequence[float]]


def window_counts(times: Sequence[float], period: float) -> tuple[list[float], list[int]]:
    """How many of ``times`` lie in the window ``(t - period, t]``, as ``t`` runs over
    every moment the count changes (a time coming in, or leaving a period later): the
    points of a step line."""
    ordered = sorted(times)
    moments = sorted({*ordered, *(t + period for t in ordered)})
    counts = [bisect_right(ordered, t) - bisect_right(ordered, t - period) for t in moments]
    return moments, counts


def _rate_name(rate: Rate) -> str:
    return f"{rate.limit}/{rate.period:g}s"


def _series(slots: Times, arrivals: Times | None, key: str) -> dict[str, Sequence[float]]:
    """A key's series, in drawing order: arrivals first, wide and pale; slots over them,
    thin and dashed: both show where they part."""
    return {"by arrival": (arrivals or {}).get(key, ()), "by slot": slots[key]}


def quota_figure(
    rates: Sequence[Rate],
    slots: Times,
    *,
    arrivals: Times | None = None,
    pauses: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    title: str = "",
) -> Figure:
    """The picture :func:`plot_quota` saves, as a matplotlib ``Figure`` of its own (no
    pyplot state, no GUI backend: safe in threads), to show, change or save yourself.

    One panel per key of ``slots`` (a row, keys sorted) and rate (a column), titled
    ``"<key>: <limit>/<period>s"``; in it, step lines labelled ``"by arrival"`` (if
    ``arrivals`` has the key) and ``"by slot"``: the requests in the rate's window
    ``(t - period, t]`` (:func:`window_counts`), over seconds from the series' first
    time; a line labelled ``"limit <N>"`` at the rate's limit; ``pauses`` (start, end),
    from the key's first slot, shaded::

        figure = quota_figure([Rate.parse("10/second")], {"token 1": slots})
        figure.axes[0].get_title()   # 'token 1: 10/1s'
        figure.savefig("quota.svg")
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "throttle_client.plot needs matplotlib: pip install 'throttle-client[plot]'"
        ) from exc
    if not rates:
        raise ValueError("a picture of a quota needs at least one rate")
    keys = sorted(slots)
    if not keys:
        raise ValueError("a picture of a quota needs the slots of at least one key")
    figure = Figure(figsize=(5.5 * len(rates), 2.6 * len(keys) + 0.6), layout="constrained")
    axes = figure.subplots(len(keys), len(rates), squeeze=False)
    for row, key in enumerate(keys):
        for column, rate in enumerate(rates):
            ax = axes[row][column]
            for name, times in _series(slots, arrivals, key).items():
                if not times:
                    continue
                start = min(times)
                moments, counts = window_counts(times, rate.period)
                style = (
                    {"ls": "--", "lw": 1, "color": "black"}
                    if name == "by slot"
                    else {"lw": 2.5, "color": "tab:orange", "alpha": 0.6}
                )
                ax.step([m - start for m in moments], counts, where="post", label=name, **style)
            ax.axhline(rate.limit, color="tab:red", lw=1, label=f"limit {rate.limit}")
            origin = min(slots[key]) if slots[key] else 0.0
            for begin, end in (pauses or {}).get(key, ()):
                ax.axvspan(begin - origin, end - origin, color="tab:gray", alpha=0.25)
            ax.set_title(f"{key}: {_rate_name(rate)}", fontsize="medium")
            ax.set_xlabel("seconds from the first request")
            ax.set_ylabel(f"requests in {rate.period:g} s")
            ax.set_ylim(0, rate.limit * 1.25)
            ax.legend(loc="lower right", fontsize="small")
    if title:
        figure.suptitle(title)
    return figure


def plot_quota(
    path: str | PathLike[str],
    rates: Sequence[Rate],
    slots: Times,
    arrivals: Times | None = None,
    pauses: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    *,
    title: str = "",
) -> dict[str, dict[str, int]]:
    """Draw, for each key of ``slots`` (a row) and each rate (a column), the requests in
    the rate's window over time, by slot and, if given, by arrival, against the limit;
    ``pauses`` (start, end) shaded (see :func:`quota_figure`). Times are seconds on any
    clock, one per series: each series is drawn from the key's first slot (arrival).
    The file's suffix picks the format (PNG, SVG, PDF). Returns, per key, the fullest
    window of each series ("10/1s by slot": 10, ...), as drawn."""
    figure = quota_figure(rates, slots, arrivals=arrivals, pauses=pauses, title=title)
    figure.savefig(path, dpi=100)
    return {
        key: {
            f"{_rate_name(rate)} {name}": max(window_counts(times, rate.period)[1])
            for rate in rates
            for name, times in _series(slots, arrivals, key).items()
            if times
        }
        for key in sorted(slots)
    }
