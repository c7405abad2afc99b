"""A key's card: its label and its limiters' rules, kept in the store
beside the key by the decisions on it, so that ``status``, ``top`` and metrics can show
which key is which without the key."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.cluster

from throttle_client import (
    AsyncLimiter,
    AsyncRedisBackend,
    Backend,
    BackendUnavailable,
    ConfigurationError,
    Event,
    Limiter,
    MemoryBackend,
    RedisBackend,
)
from throttle_client._backends.base import Op
from throttle_client._cards import Card
from throttle_client.testing import FakeClock

TOKEN = "ghp_card_test_token_7f3a"


def account(key: str) -> str:
    return f"account {key[-2:]}"


@pytest.fixture
def store(every_store: Backend) -> Backend:
    return every_store


def test_a_decision_keeps_the_card_beside_its_key_and_a_reset_drops_it(store: Backend) -> None:
    limiter = Limiter(
        store,
        rates=["5/minute", "100/hour"],
        min_interval=0.5,
        namespace="gh",
        label=account,
        history=True,
    )
    other = Limiter(store, rates="9/second", namespace="other")  # keeps no history
    keys = [f"{TOKEN}{n:02d}" for n in range(12)]
    for key in keys:
        assert limiter.try_acquire(key).allowed
    assert other.try_acquire(TOKEN).allowed

    mine = [limiter.store_key(key) for key in keys]
    cards = store.cards([*mine, "gh:{nothing-here}"])
    assert set(cards) == set(mine)
    for key, store_key in zip(keys, mine, strict=True):
        card = Card.parse(cards[store_key])
        assert card == Card(
            label=account(key),
            namespace="gh",
            rates=("5/60s", "100/3600s"),
            min_interval=0.5,
            margin=limiter.margin,
            max_concurrent=None,
            zone="UTC",  # its usage history's
        )
        assert key not in cards[store_key]
    every = dict(store.all_cards())
    assert set(every) == {*mine, other.store_key(TOKEN)}
    assert Card.parse(every[other.store_key(TOKEN)]) == Card(
        None, "other", ("9/1s",), 0.0, other.margin, None, None
    )

    store.forget(mine[0])
    assert mine[0] not in dict(store.all_cards())
    assert store.cards([mine[0]]) == {}


def test_a_stacked_capped_call_keeps_each_keys_card(store: Backend) -> None:
    tag = "acct-7"
    token = Limiter(
        store,
        rates="10/second",
        max_concurrent=2,
        namespace="tok",
        tag=lambda _: tag,
        label=account,
        history=True,
    )
    acct = Limiter(store, rates="100/minute", namespace="acct", tag=lambda _: tag)
    with token.lease(TOKEN, also=[(acct, "account-7")]):
        pass
    cards = {k: Card.parse(v) for k, v in store.all_cards()}
    assert cards[token.store_key(TOKEN)] == Card(
        account(TOKEN), "tok", ("10/1s",), 0.0, token.margin, 2, "UTC"
    )
    assert cards[acct.store_key("account-7")] == Card(
        None, "acct", ("100/60s",), 0.0, acct.margin, None, None
    )


class Recording(MemoryBackend):
    """A memory store that notes the cards each decision carries."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.carried: list[int] = []  # per decision the store answered, its cards
        self.down = False

    def execute(self, op: Op[Any]) -> Any:
        if hasattr(op, "cards") and not self.down:
            self.carried.append(len(op.cards))
        if self.down:
            raise BackendUnavailable("down for the test")
        return super().execute(op)


def test_a_card_goes_with_the_first_decision_then_every_half_horizon() -> None:
    clock = FakeClock()
    store = Recording()
    # Horizon: the longest period (10 s) and the margin: a card every 5.0125 s.
    limiter = Limiter(store, rates=["100/10s", "10/second"], clock=clock, margin=0.025)
    limiter.try_acquire(TOKEN)
    limiter.try_acquire(TOKEN)
    limiter.try_acquire("another")
    clock.advance(5.0)
    limiter.try_acquire(TOKEN)
    clock.advance(0.02)
    limiter.try_acquire(TOKEN)
    assert store.carried == [1, 0, 1, 0, 1]

    # The card lives the key's TTL, or the horizon if longer: gone when the key is.
    store_key = limiter.store_key(TOKEN)
    assert store_key in store.cards([store_key])
    clock.advance(30)
    limiter.try_acquire("another")  # (the store's time moves on with the calls)
    assert store.cards([store_key]) == {}

    # A card that did not reach the store goes with the next decision that does.
    down = Limiter(store, rates="10/minute", clock=clock, on_unavailable="allow")
    store.carried.clear()
    store.down = True
    down.try_acquire("k")
    store.down = False
    clock.advance(5)  # (the limiter rests a store that failed a moment: not 30 s)
    down.try_acquire("k")
    down.try_acquire("k")
    assert store.carried == [1, 0]


@pytest.mark.parametrize(
    ("label", "message"),
    [
        (lambda key: 42, "not a int"),
        (lambda key: ("acct", key), "not a tuple"),
        (lambda key: "", "not 0"),
        (lambda key: "x" * 65, "not 65"),
        (lambda key: "two\nlines", "not printable"),
        (lambda key: f"is {key}", "holds the key itself"),
        (lambda key: f"user {key}" * 3, "holds the key itself"),  # too long, and the key
        (lambda key: f"\t{key[:10]}", "not printable"),  # a part of the key, unprintable
        (lambda key: {"known": "acct"}[key], "label= raised KeyError"),  # its message: the key
        (lambda key: "   ", "blank"),
    ],
)
def test_a_bad_label_is_refused_and_never_shows_the_key(
    label: Callable[[str], Any], message: str
) -> None:
    store = MemoryBackend()
    limiter = Limiter(store, rates="5/second", label=label)
    with pytest.raises(ConfigurationError, match=message) as raised:
        limiter.try_acquire(TOKEN)
    assert TOKEN[:10] not in str(raised.value)
    assert list(store.all_cards()) == []  # nothing half-written


def test_a_label_error_carries_nothing_of_the_first() -> None:
    limiter = Limiter(MemoryBackend(), rates="5/second", label={"known": "acct"}.__getitem__)
    with pytest.raises(ConfigurationError) as raised:
        limiter.try_acquire(TOKEN)
    assert raised.value.__cause__ is None and raised.value.__context__ is None
    # A card whose label is not known here (past the keys a limiter remembers) is not
    # written: it would erase the label another worker wrote.
    assert limiter._plan.card_of("default:{never-asked}") == ()


def test_a_label_of_none_is_the_hashs_label() -> None:
    store = MemoryBackend()
    accounts = {"ghp_known_token": "account 42"}
    limiter = Limiter(store, rates="5/second", label=accounts.get)
    assert limiter.try_acquire("ghp_known_token").allowed
    assert limiter.try_acquire(TOKEN).allowed  # no name: not an error
    assert limiter.label("ghp_known_token") == "account 42"
    assert limiter.label(TOKEN) == limiter.store_key(TOKEN)[len("default:{") :][:8]
    cards = {k: Card.parse(v) for k, v in store.all_cards()}
    assert cards[limiter.store_key(TOKEN)].label is None  # type: ignore[union-attr]


def test_label_must_be_a_function() -> None:
    with pytest.raises(TypeError, match="label must be a function of a key, not 'acct'"):
        Limiter(MemoryBackend(), rates="5/second", label="acct")  # type: ignore[arg-type]


def test_events_and_the_label_method_show_the_users_label() -> None:
    limiter = Limiter(MemoryBackend(), rates="1/second", label=account, clock=FakeClock())
    events: list[Event] = []
    limiter.listen(events.append)
    limiter.try_acquire(TOKEN)
    limiter.try_acquire(TOKEN)
    assert [(e.kind, e.key) for e in events] == [
        ("admitted", account(TOKEN)),
        ("refused", account(TOKEN)),
    ]
    assert limiter.label(TOKEN) == account(TOKEN)
    plain = Limiter(MemoryBackend(), rates="1/second")
    assert plain.label(TOKEN) == plain.store_key(TOKEN)[len("default:{") :][:8]


@pytest.mark.parametrize("where", ["redis", "cluster"])
def test_cards_ride_in_batches_of_many_tasks(where: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(f"{where}_url")

    async def main() -> list[bool]:
        backend = AsyncRedisBackend(url, cluster=where == "cluster")
        # margin=0: on a loaded machine an answer may come later than the margin, and a
        # try_acquire's call would then hear back too late and be refused (docs/concepts.md,
        # "The margin").
        limiter = AsyncLimiter(
            backend, rates="3/minute", namespace="batch", label=account, margin=0
        )
        try:
            calls = [limiter.try_acquire(f"{TOKEN}{n % 40:02d}") for n in range(200)]
            return [d.allowed for d in await asyncio.gather(*calls)]
        finally:
            await backend.aclose()

    allowed = asyncio.run(main())
    # Every key's decisions came back in order and right: 3 of its 5 admitted.
    assert sum(allowed) == 40 * 3
    with RedisBackend(url, cluster=where == "cluster") as reader:
        cards = {k: Card.parse(v) for k, v in reader.all_cards()}
    assert len(cards) == 40
    assert {c.label for c in cards.values() if c} == {account(f"{n:02d}") for n in range(40)}


def test_a_card_outlives_its_key_in_redis_even_when_paused(redis_url: str) -> None:
    limiter = Limiter(RedisBackend(redis_url), rates=["5/minute", "50/hour"], label=account)
    client = redis.Redis.from_url(redis_url)
    prefix = f"tc:{limiter.store_key(TOKEN)}:"

    def ttls() -> tuple[int, int]:
        return client.pttl(prefix + "card"), client.pttl(prefix + "meta")

    limiter.try_acquire(TOKEN)
    card, meta = ttls()
    # The key lives an hour past its newest slot (and a tenth more); its card, written
    # again every half hour, 1.6 hours: never less than the key.
    assert meta <= card <= 1.6 * 3_600_000 + 25_000, (card, meta)
    assert json.loads(client.get(prefix + "card"))["label"] == account(TOKEN)
    limiter.pause(TOKEN, 3 * 3600)  # a pause holds the key longer: its card goes along
    card, meta = ttls()
    assert card >= meta > 3 * 3_600_000, (card, meta)
    client.close()


def test_a_failed_decision_gives_its_card_back() -> None:
    store = Recording()
    clock = FakeClock()
    limiter = Limiter(store, rates="10/minute", clock=clock, retry_for=0)  # raise
    store.down = True
    with pytest.raises(BackendUnavailable):
        limiter.try_acquire(TOKEN)
    store.down = False
    clock.advance(5)
    limiter.try_acquire(TOKEN)
    limiter.try_acquire(TOKEN)
    assert store.carried == [1, 0]  # the card went with the first decision that landed


def test_a_cluster_scan_finds_cards_on_every_primary(cluster_url: str) -> None:
    backend = RedisBackend(cluster_url, cluster=True)
    limiter = Limiter(backend, rates="5/minute", namespace="wide")
    keys = [f"token-{n}" for n in range(60)]
    for key in keys:
        limiter.try_acquire(key)
    client = redis.cluster.RedisCluster.from_url(cluster_url)
    primaries = {client.get_node_from_key(f"tc:{limiter.store_key(key)}:card").name for key in keys}
    client.close()
    assert len(primaries) >= 2  # the cards are spread: the scan must visit each node
    assert {k for k, _ in backend.all_cards()} == {limiter.store_key(key) for key in keys}
    backend.close()
