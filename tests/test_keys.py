"""Store keys: an HMAC of (namespace, key) under a secret, with the library's hash tag."""

from __future__ import annotations

import re

import pytest

from throttle_client import ConfigurationError, Limiter, MemoryBackend
from throttle_client._keys import SECRET_ENV, check_namespace, resolve_secret
from throttle_client._keys import hashed_key as store_key

TOKEN = "EAAB-access-token-0123456789abcdef"
SECRET = b"s3cret"


def test_same_inputs_same_key() -> None:
    assert store_key(SECRET, "ig", TOKEN) == store_key(SECRET, "ig", TOKEN)


def test_namespace_secret_and_key_all_change_the_store_key() -> None:
    keys = {
        store_key(SECRET, "ig", TOKEN),
        store_key(SECRET, "fb", TOKEN),
        store_key(b"other secret", "ig", TOKEN),
        store_key(SECRET, "ig", TOKEN + "x"),
        # The separator keeps (namespace, key) pairs apart that concatenate alike.
        store_key(SECRET, "i", "g" + TOKEN),
    }
    assert len(keys) == 5


def test_the_key_is_a_hash_tag_that_hides_the_token() -> None:
    key = store_key(SECRET, "ig", TOKEN)
    match = re.fullmatch(r"ig:\{([A-Za-z0-9_-]{22})\}", key)
    assert match, key
    for part in (TOKEN, "EAAB", "0123456789"):
        assert part not in key


@pytest.mark.parametrize("namespace", ["a{b", "a}b", "{tag}", ""])
def test_braces_and_empty_namespaces_are_refused(namespace: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        check_namespace(namespace)
    assert repr(namespace) in str(error.value)


def test_a_non_str_key_is_refused_without_echoing_it() -> None:
    with pytest.raises(TypeError) as error:
        store_key(SECRET, "ig", TOKEN.encode())  # type: ignore[arg-type]
    assert "bytes" in str(error.value) and "EAAB" not in str(error.value)


def test_the_secret_comes_from_the_argument_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    default = resolve_secret(None)
    assert resolve_secret("abc") == resolve_secret(b"abc") == b"abc"
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert resolve_secret(None) == b"from-env" != default
    assert resolve_secret("abc") == b"abc"  # an explicit secret wins
    with pytest.raises(ConfigurationError):
        resolve_secret(b"")


def test_limiters_with_different_secrets_do_not_share_logs() -> None:
    backend = MemoryBackend()
    one = Limiter(backend, rates=["1/minute"], key_secret="one")
    same = Limiter(backend, rates=["1/minute"], key_secret="one")
    two = Limiter(backend, rates=["1/minute"], key_secret="two")
    assert one.try_acquire(TOKEN)
    assert not same.try_acquire(TOKEN)
    assert two.try_acquire(TOKEN)


def test_the_public_store_key_is_the_limiters() -> None:
    from throttle_client import store_key as public_store_key

    limiter = Limiter(MemoryBackend(), rates=["1/second"], namespace="gh", key_secret=SECRET)
    assert public_store_key(TOKEN, namespace="gh", key_secret=SECRET) == limiter.store_key(TOKEN)
    assert public_store_key(TOKEN) != limiter.store_key(TOKEN)  # another namespace and secret
    with pytest.raises(ConfigurationError, match="namespace"):
        public_store_key(TOKEN, namespace="")
