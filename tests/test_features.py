"""A store declares what it keeps beyond the plain decision (``Backend.features``): a
limiter that needs a feature its store lacks is refused when it is made, naming both, and
side data the store does not keep is never sent."""

from __future__ import annotations

from typing import Any

import pytest

from throttle_client import (
    AsyncLimiter,
    ConfigurationError,
    Decision,
    Limiter,
    MemoryBackend,
    Rate,
)
from throttle_client._backends.base import FEATURES, Acquire, Learn, Op
from throttle_client.testing import FakeClock


class Noting(MemoryBackend):
    """A store of every feature that notes every operation."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op[Any]] = []

    def execute(self, op: Op[Any]) -> Any:
        self.ops.append(op)
        return super().execute(op)


class Plain(Noting):
    """One that keeps only the plain decision."""

    features = frozenset()


def test_the_stores_keep_every_feature() -> None:
    assert MemoryBackend().features == FEATURES
    assert MemoryBackend().to_async().features == FEATURES


@pytest.mark.parametrize(
    ("settings", "feature"),
    [
        ({"max_concurrent": 2}, "leases (which max_concurrent=2 needs)"),
        ({"history": True}, "history (which history= needs)"),
        ({"rates": ["100/day in UTC"]}, "calendar (which the calendar rate"),
        ({"rates": ["100/day, bounded"]}, "bounded (which the bounded rate"),
    ],
)
@pytest.mark.parametrize("limiter", [Limiter, AsyncLimiter])
def test_a_limiter_that_needs_what_its_store_lacks_is_refused(
    limiter: type[Any], settings: dict[str, Any], feature: str
) -> None:
    arguments = {"rates": ["10/second"], **settings}
    with pytest.raises(ConfigurationError) as refused:
        limiter(Plain(), **arguments)
    assert str(refused.value).startswith("Plain does not keep " + feature)


def test_a_stacked_call_on_a_store_that_cannot_is_refused() -> None:
    store = Plain()
    token = Limiter(store, rates=["10/second"], namespace="token")
    account = Limiter(store, rates=["100/second"], namespace="account")
    with pytest.raises(ConfigurationError, match="does not keep the 'stacked' feature"):
        token.try_acquire("t", also=[(account, "a")])
    assert not [op for op in store.ops if isinstance(op, Acquire)]  # nothing was sent


def test_a_plain_limiter_sends_no_side_data_its_store_does_not_keep() -> None:
    store = Plain()
    clock = FakeClock()
    limiter = Limiter(store, rates=[Rate(10, 60)], label=lambda key: "acct 1", clock=clock)
    for _ in range(3):
        assert limiter.try_acquire("t").allowed
    assert limiter.usage("t").rates[0].used == 3
    acquires = [op for op in store.ops if isinstance(op, Acquire)]
    assert len(acquires) == 3 and all(op.cards == () for op in acquires)
    # Headers stricter than the rates: read, and not kept (the store keeps no learned limit).
    decision = limiter.try_acquire("t")
    view = limiter.learn("t", decision, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "30"})
    assert isinstance(decision, Decision) and view is not None and view.remaining == 0
    assert not [op for op in store.ops if isinstance(op, Learn)]
    assert limiter.usage("t").learned is None


def test_the_same_limiter_on_a_store_that_keeps_all_sends_them() -> None:
    store = Noting()
    limiter = Limiter(store, rates=[Rate(10, 60)], label=lambda key: "acct 1", clock=FakeClock())
    decision = limiter.try_acquire("t")
    limiter.learn("t", decision, {"X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "30"})
    assert [op.cards != () for op in store.ops if isinstance(op, Acquire)] == [True]
    assert [op for op in store.ops if isinstance(op, Learn)]
