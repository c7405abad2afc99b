"""A picture of a quota (issue 12): per key and rate, the requests in the rate's sliding
window over time, by arrival (as the upstream counts them) and by slot (as the limiter
booked them), against the limit; pauses shaded. Needs matplotlib (the ``plot`` extra)::

    from throttle_client.plot import plot_quota

    plot_quota("quota.png", limiter.rates, slots={"token 1": [...]}, arrivals={...})

``throttle-client demo --plot quota.png`` draws one from the demo's own run.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from os import PathLike

from ._rate import Rate

__all__ = ["plot_quota", "window_counts"]

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
    ``pauses`` (start, end) shaded. Times are seconds on any clock, one per series: each
    series is drawn from the key's first slot (arrival). The file's suffix picks the
    format (PNG, SVG, PDF). Returns, per key, the fullest window of each series
    ("10/1s by slot": 10, ...), as drawn."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(
            "plot_quota needs matplotlib: pip install 'throttle-client[plot]'"
        ) from exc
    if not rates:
        raise ValueError("plot_quota needs at least one rate")
    keys = sorted(slots)
    if not keys:
        raise ValueError("plot_quota needs the slots of at least one key")
    # A Figure of its own, not pyplot: no global state, no GUI backend, safe in threads.
    figure = Figure(figsize=(5.5 * len(rates), 2.6 * len(keys) + 0.6), layout="constrained")
    axes = figure.subplots(len(keys), len(rates), squeeze=False)
    peaks: dict[str, dict[str, int]] = {}
    for row, key in enumerate(keys):
        # Arrivals first, wide and pale; slots over them, thin and dashed: both show
        # where they part.
        series = {"by arrival": (arrivals or {}).get(key, ()), "by slot": slots[key]}
        peaks[key] = {}
        for column, rate in enumerate(rates):
            ax = axes[row][column]
            for name, times in series.items():
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
                peaks[key][f"{_rate_name(rate)} {name}"] = max(counts)
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
    figure.savefig(path, dpi=100)
    return peaks
