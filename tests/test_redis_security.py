"""rediss:// against a TLS redis-server with a CA made by the test, and a least-privilege ACL
user holding exactly the permissions the docs document."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import started
from tests.handoff import handoff_seconds
from tests.tls import make_certs, tls_redis_server
from throttle_client import BackendError, BackendUnavailable, Limiter, RedisBackend
from throttle_client._flow import run
from throttle_client._key_flows import pause_flow
from throttle_client._redis_server import free_port
from throttle_client.testing import RedisServer

# The second tier (pytest -m slow): see pyproject.toml.
pytestmark = pytest.mark.slow

ACL_PAGE = Path(__file__).resolve().parent.parent / "docs" / "operations" / "acl.md"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, int, dict]]:
    certs = make_certs(tmp_path_factory.mktemp("certs"))
    try:
        binary = tls_redis_server()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)
    tls_port = free_port()
    server = RedisServer(
        binary=binary,
        args=(
            "--tls-port", str(tls_port),
            "--tls-cert-file", str(certs["server"]),
            "--tls-key-file", str(certs["server-key"]),
            "--tls-ca-cert-file", str(certs["ca"]),
            "--tls-auth-clients", "no",
        ),
    )  # fmt: skip
    started(server)
    yield server, tls_port, certs
    server.close()


def test_rediss_url_with_the_test_ca(tls_server) -> None:
    _, tls_port, certs = tls_server
    url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={certs['ca']}"
    limiter = Limiter(RedisBackend(url), rates=["2/second"])
    assert [limiter.try_acquire("token").allowed for _ in range(3)] == [True, True, False]
    assert limiter.usage("token").rates[0].used == 2


def test_a_wrong_ca_is_a_clear_error_never_unavailable(tls_server) -> None:
    _, tls_port, certs = tls_server
    url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={certs['other-ca']}"
    # Even failing open, a certificate the client cannot verify is not an outage.
    limiter = Limiter(RedisBackend(url), rates=["2/second"], on_unavailable="allow")
    with pytest.raises(BackendError) as info:
        limiter.try_acquire("token")
    assert not isinstance(info.value, BackendUnavailable)
    assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)


def documented_acl() -> str:
    """The `ACL SETUSER` line of the ACL page of the docs."""
    match = re.search(r"^ACL SETUSER .+$", ACL_PAGE.read_text(), re.MULTILINE)
    assert match, "docs/operations/acl.md must document the ACL the limiter needs"
    return match.group(0)


def test_the_documented_acl_is_enough(redis_url: str) -> None:
    admin = redis.Redis.from_url(redis_url)
    words = documented_acl().split()[2:]  # drop "ACL SETUSER"
    user, rules = words[0], [">s3cret" if w.startswith(">") else w for w in words[1:]]
    admin.execute_command("ACL", "SETUSER", user, "reset", *rules)
    try:
        url = redis_url.replace("redis://", f"redis://{user}:s3cret@")
        limiter = Limiter(RedisBackend(url), rates=["3/second", "10/minute"], min_interval=0.01)
        assert limiter.try_acquire("token").allowed
        assert limiter.acquire("token", timeout=1).allowed
        assert limiter.usage("token").rates[1].used == 2
        assert limiter.pause("token", 0.01) > 0
        limiter.reset("token")
        admin.script_flush()  # the limiter must be allowed to load its script again
        assert limiter.try_acquire("token").allowed
        # A card with the decision, and a transport's pushback with its pause.
        labelled = Limiter(
            RedisBackend(url),
            rates="5/second",
            namespace="acl",
            label=lambda key: "acct 1",
            history=True,
        )
        assert labelled.try_acquire("token").allowed
        told = {"reason": "Retry-After", "source": "upstream", "refused": True}
        run(pause_flow(labelled, "token", 30, labelled._local(), **told), labelled._perform)
        prefix = f"tc:{labelled.store_key('token')}:"
        assert json.loads(admin.get(prefix + "card"))["label"] == "acct 1"
        assert admin.hget(prefix + "pushback", "reason") == b"Retry-After"
        assert [p.calls for p in labelled.history("token").days] == [1]  # counted, and read
        labelled.backend.close()
        # A capped limiter: its waiter is woken by a grant published to its process.
        capped = Limiter(RedisBackend(url), rates=["100/second"], max_concurrent=1, margin=0)
        assert handoff_seconds(capped) < 1.5  # woken, not looking again 10 s later
        assert capped.usage("token").in_flight == 0
        capped.backend.close()
        limiter.backend.close()
        restricted = redis.Redis.from_url(url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            restricted.keys("tc:*")  # only what the docs list, nothing more
        restricted.close()
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


@pytest.mark.parametrize("world", ["sync", "async"])
def test_a_capped_limiter_over_tls_wakes_its_waiter(tls_server, world: str) -> None:
    """The grant's subscriber connects as the store's client does: over TLS, same CA."""
    _, tls_port, certs = tls_server
    url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={certs['ca']}"
    if world == "sync":
        limiter = Limiter(RedisBackend(url), rates=["100/second"], max_concurrent=1, margin=0)
        took = handoff_seconds(limiter)
        limiter.backend.close()
    else:
        from throttle_client import AsyncLimiter, AsyncRedisBackend

        async def main() -> float:
            limiter = AsyncLimiter(
                AsyncRedisBackend(url), rates=["100/second"], max_concurrent=1, margin=0
            )
            holder = limiter.lease("token")
            await holder.__aenter__()
            asyncio.get_running_loop().call_later(
                0.2, lambda: asyncio.ensure_future(holder.release())
            )
            started = time.monotonic()
            async with limiter.lease("token", timeout=5):
                took = time.monotonic() - started
            await limiter.backend.aclose()
            return took

        took = asyncio.run(main())
    assert 0.15 < took < 1.5  # woken by the grant, not looking again 10 s later
