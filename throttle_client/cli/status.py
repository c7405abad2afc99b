"""``status``, ``reset`` and ``history``: a look at, or a reset of, the keys given on the
command line, each hashed to its store key exactly as the library hashes it.

A key is an access token: it is never printed. Each is shown by its number on the
command line and its store key (``key 1``, ``store key ...``), which are safe to show.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from typing import Any

from throttle_client import Card, History, Limiter, store_key

from . import demo as _demo
from .arguments import EXIT_OK, SECRET_ENV, UsageError, open_store, read_keys


def _label(number: int, hashed: str) -> dict[str, str]:
    # Never the key itself: it is an access token. Its store key is safe to show.
    return {"key": f"key {number}", "store_key": hashed}


def cmd_status(args: argparse.Namespace) -> int:
    if args.rate is None and (args.min_interval is not None or args.margin is not None):
        raise UsageError(
            "--min-interval and --margin go with --rate: without it, the card's rules apply"
        )
    keys = read_keys(args)
    tag = None if args.tag is None else (lambda _key: args.tag)
    with open_store(args) as backend:
        hashed = [store_key(key, namespace=args.namespace, tag=args.tag) for key in keys]
        # Each key's card: the label and the rules its limiters gave it.
        cards = {k: Card.parse(text) for k, text in backend.cards(hashed).items()}
        usages = []
        for number, (key, hashed_key) in enumerate(zip(keys, hashed, strict=True), 1):
            card = cards.get(hashed_key)
            rules: tuple[list[Any], float, float, int | None]
            if args.rate is not None:
                gap = 0.0 if args.min_interval is None else args.min_interval
                margin = _demo.DEFAULT_MARGIN if args.margin is None else args.margin
                rules = (args.rate, gap, margin, None)
            elif card is not None:
                rules = (list(card.rates), card.min_interval, card.margin, card.max_concurrent)
            else:
                raise UsageError(
                    f"key {number} has no card in the store that this version can read: "
                    "no limiter used it within its longest window (is --namespace right? "
                    f"the key secret in ${SECRET_ENV}?), or its card is damaged; pass its "
                    "rates with --rate"
                )
            rates, gap, margin, cap = rules
            limiter = Limiter(
                backend,
                rates=rates,
                min_interval=gap,
                margin=margin,
                namespace=args.namespace,
                tag=tag,
                max_concurrent=cap,
            )
            usages.append(limiter.usage(key))
    report: list[dict[str, Any]] = []
    for number, (hashed_key, usage) in enumerate(zip(hashed, usages, strict=True), 1):
        card = cards.get(hashed_key)
        report.append(
            {
                **_label(number, hashed_key),
                "label": None if card is None else card.label,
                "rates": [
                    {
                        "rate": str(r.rate),
                        "used": r.used,
                        "booked": r.booked,
                        "remaining": r.remaining,
                        "resets_in": round(r.resets_in, 6),
                        "resets_at": r.resets_at,  # a calendar rate: its window's end
                    }
                    for r in usage.rates
                ],
                "next_slot_in": round(usage.next_slot_in, 6),
                "paused_for": round(usage.paused_for, 6),
                "paused_until": usage.paused_until,
                "in_flight": usage.in_flight,  # a capped key: calls in flight, queued
                "waiting": usage.waiting,
                "learned": None
                if usage.learned is None
                else {
                    "limit": usage.learned.limit,
                    "used": usage.learned.used,
                    "resets_at": usage.learned.resets_at,
                },
            }
        )
    if args.json:
        print(json.dumps({"namespace": args.namespace, "keys": report}))
        return EXIT_OK
    for entry in report:
        label = "" if entry["label"] is None else f", label {entry['label']!r}"
        print(f"{entry['key']}  (store key {entry['store_key']}{label})")
        width = max(14, *(len(r["rate"]) for r in entry["rates"]))  # (one column of rates)
        for r in entry["rates"]:
            wait = f", a call can go in {r['resets_in']:.3f} s" if r["resets_in"] else ""
            counts = f"used {r['used']}, booked {r['booked']}, remaining {r['remaining']}"
            window = "" if r["resets_at"] is None else f", window ends {_when(r['resets_at'])}"
            print(f"  {r['rate']:<{width}} {counts}{wait}{window}")
        learned = entry["learned"]
        if learned is not None:
            print(
                f"  learned from the upstream: {learned['used']} of {learned['limit']} "
                f"until {_when(learned['resets_at'])}"
            )
        wait = entry["next_slot_in"]
        print(f"  next free slot: {'now' if wait == 0 else f'in {wait:.3f} s'}")
        paused = entry["paused_for"]
        print(f"  paused: {'no' if paused == 0 else f'for {paused:.3f} s more'}")
        if entry["in_flight"] is not None:
            print(f"  in flight: {entry['in_flight']}, queued: {entry['waiting']}")
    return EXIT_OK


def _when(epoch: float) -> str:
    """An epoch time as UTC, to the second."""
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def cmd_reset(args: argparse.Namespace) -> int:
    keys = read_keys(args)
    with open_store(args) as backend:
        for number, key in enumerate(keys, 1):
            # The store key alone names the log: no rates are needed to forget it.
            hashed = store_key(key, namespace=args.namespace, tag=args.tag)
            backend.forget(hashed)
            label = _label(number, hashed)
            print(f"reset {label['key']} (store key {label['store_key']})")
    return EXIT_OK


def cmd_history(args: argparse.Namespace) -> int:
    keys = read_keys(args)
    report: list[dict[str, Any]] = []
    with open_store(args) as backend:
        for number, key in enumerate(keys, 1):
            hashed = store_key(key, namespace=args.namespace, tag=args.tag)
            card = Card.parse(backend.cards([hashed]).get(hashed, ""))
            # The zone the limiters count in, as their card says; with no card (it
            # lasts as long as the key, the history far longer), the offset the store
            # kept. (The rates do not matter to a read of the history.)
            zone = card.zone if card is not None else None
            reader = Limiter(
                backend,
                rates="1/second",
                namespace=args.namespace,
                tag=None if args.tag is None else (lambda _key: args.tag),
                history=History(zone=zone) if zone else False,
            )
            used = reader.history(key)
            report.append(
                {
                    **_label(number, hashed),
                    "label": None if card is None else card.label,
                    "zone": used.zone,
                    **{
                        grain: [
                            {"start": p.start.isoformat(), "calls": p.calls, "cost": p.cost}
                            for p in getattr(used, grain)
                        ]
                        for grain in ("hours", "days", "months")
                    },
                }
            )
    if args.json:
        print(json.dumps({"namespace": args.namespace, "keys": report}))
        return EXIT_OK
    shapes = {"hours": "%Y-%m-%d %H:00", "days": "%Y-%m-%d", "months": "%Y-%m"}
    for entry in report:
        label = "" if entry["label"] is None else f", label {entry['label']!r}"
        print(f"{entry['key']}  (store key {entry['store_key']}{label}), in {entry['zone']}")
        for grain, shape in shapes.items():
            rows = entry[grain]
            if not rows:
                print(f"  {grain}: none")
            for row in rows:
                start = datetime.fromisoformat(row["start"]).strftime(shape)
                cost = f", cost {row['cost']}" if row["cost"] != row["calls"] else ""
                print(f"  {start:<16} {row['calls']} calls{cost}")
    return EXIT_OK
