"""Store keys: a keyed hash of (namespace, key), so an access token never reaches a store."""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os

from ._errors import ConfigurationError

SECRET_ENV = "THROTTLE_CLIENT_KEY_SECRET"
# Used when no secret is configured. Tokens are high-entropy, so even under this public
# secret the hash is one-way; set your own to stop anyone from testing guessed tokens.
_DEFAULT_SECRET = b"throttle_client/v1"


def resolve_secret(secret: bytes | str | None) -> bytes:
    if secret is None:
        from_env = os.environ.get(SECRET_ENV)
        return from_env.encode() if from_env else _DEFAULT_SECRET
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or not secret:
        raise ConfigurationError("key_secret must be non-empty bytes or str")
    return secret


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not namespace:
        raise ConfigurationError(f"namespace must be a non-empty string, not {namespace!r}")
    if "{" in namespace or "}" in namespace:
        # The library owns the {hash tag} that keeps one key's data in one Cluster slot.
        raise ConfigurationError(f"namespace must not contain braces: {namespace!r}")
    return namespace


def store_key(secret: bytes, namespace: str, key: str) -> str:
    """``<namespace>:{<22 chars of HMAC-SHA256>}``: the brace part is the Cluster hash tag."""
    if not isinstance(key, str):
        # Never echo a key's value: it is usually an access token.
        raise TypeError(f"a throttling key must be a str, not {type(key).__name__}")
    if not key:
        raise ConfigurationError("a throttling key must be a non-empty string")
    return _derive(secret, namespace, key)


# A worker asks about the same few tokens over and over: remembering their last few
# thousand store keys saves the HMAC on every decision. The raw keys stay in this
# process's memory, as they already are in the caller's; nothing is written anywhere.
@functools.lru_cache(maxsize=4096)
def _derive(secret: bytes, namespace: str, key: str) -> str:
    digest = hmac.new(secret, f"{namespace}\x00{key}".encode(), hashlib.sha256).digest()
    return f"{namespace}:{{{base64.urlsafe_b64encode(digest[:16]).decode().rstrip('=')}}}"
