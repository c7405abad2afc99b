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
        try:
            secret = secret.encode()
        except UnicodeEncodeError as exc:  # a lone surrogate; never echo the secret
            raise ConfigurationError(_not_utf8("key_secret", exc.start, len(secret))) from None
    if not isinstance(secret, bytes) or not secret:
        raise ConfigurationError("key_secret must be non-empty bytes or str")
    return secret


def check_namespace(namespace: str) -> str:
    if not isinstance(namespace, str) or not namespace:
        raise ConfigurationError(f"namespace must be a non-empty string, not {namespace!r}")
    if "{" in namespace or "}" in namespace:
        # The library owns the {hash tag} that keeps one key's data in one Cluster slot.
        raise ConfigurationError(f"namespace must not contain braces: {namespace!r}")
    if "\x00" in namespace:
        # NUL separates namespace from key in the hashed text: ("a\0b", "c") and
        # ("a", "b\0c") must not share a log.
        raise ConfigurationError(f"namespace must not contain NUL: {namespace!r}")
    try:
        namespace.encode()
    except UnicodeEncodeError as exc:
        where = _not_utf8("namespace", exc.start, len(namespace))
        raise ConfigurationError(f"{where}: {namespace!r}") from None
    return namespace


def store_key(
    key: str,
    *,
    namespace: str = "default",
    key_secret: bytes | str | None = None,
    tag: str | None = None,
) -> str:
    """The name under which the stores keep ``key``'s log: ``<namespace>:{<22 characters
    of HMAC-SHA256>}``, or with a ``tag`` (what the keys of one stacked call share, e.g.
    an account id) ``<namespace>:{<22 characters for the tag>}<22 for the key>``. Not
    secret, so logs and ``throttle-client status`` show it; neither the token nor the
    tag can be read back out of it. ``Limiter.store_key`` gives the same for a limiter's
    own namespace, secret and tag.

    >>> store_key("ghp_token", namespace="github")
    'github:{...}'
    """
    return hashed_key(resolve_secret(key_secret), check_namespace(namespace), key, tag)


def hashed_key(secret: bytes, namespace: str, key: str, tag: str | None = None) -> str:
    """``store_key`` with a resolved secret and a checked namespace. The brace part is
    the Cluster hash tag: both Redis keys of one log live in one slot, and so do the
    logs of every key with the same ``tag``."""
    if tag is not None:
        digest = hashed_key(secret, namespace, key)[len(namespace) + 2 : -1]
        return f"{namespace}:{{{_tag_digest(secret, _checked_tag(tag))}}}{digest}"
    if not isinstance(key, str):
        # Never echo a key's value: it is usually an access token.
        raise TypeError(f"a throttling key must be a str, not {type(key).__name__}")
    if not key:
        raise ConfigurationError("a throttling key must be a non-empty string")
    try:
        return _derive(secret, namespace, key)
    except UnicodeEncodeError as exc:
        # Found by the hash's own encoding (good keys pay nothing) of the text
        # namespace + NUL + key, whose namespace is known to encode. The codec's
        # message, which counts in that text, is left out of the chain.
        where = _not_utf8("a throttling key", exc.start - len(namespace) - 1, len(key))
        raise ConfigurationError(where) from None


def fingerprint(secret: bytes) -> str:
    """8 characters that tell one key secret from another without revealing it: what a
    namespace's record in the store holds, so that workers hashing keys with different
    secrets (one token, two logs, two quotas) find out."""
    digest = hmac.new(secret, b"throttle_client key secret", hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest[:6]).decode()


def _not_utf8(what: str, position: int, length: int) -> str:
    """Where a str fails to encode, by position and length only: it may be a secret."""
    return (
        f"{what} must encode to UTF-8: the character at position {position} "
        f"(of {length}) is a lone surrogate"
    )


# A worker asks about the same few tokens over and over: remembering their last few
# thousand store keys saves the HMAC on every decision. The raw keys stay in this
# process's memory, as they already are in the caller's; nothing is written anywhere.
@functools.lru_cache(maxsize=4096)
def _derive(secret: bytes, namespace: str, key: str) -> str:
    digest = hmac.new(secret, f"{namespace}\x00{key}".encode(), hashlib.sha256).digest()
    return f"{namespace}:{{{base64.urlsafe_b64encode(digest[:16]).decode().rstrip('=')}}}"


def _checked_tag(tag: object) -> str:
    if not isinstance(tag, str) or not tag:
        # A tag is often an account id: named by its type only, like a key.
        raise ConfigurationError(f"a tag must be a non-empty string, not a {type(tag).__name__}")
    try:
        tag.encode()
    except UnicodeEncodeError as exc:
        raise ConfigurationError(_not_utf8("a tag", exc.start, len(tag))) from None
    return tag


@functools.lru_cache(maxsize=4096)
def _tag_digest(secret: bytes, tag: str) -> str:
    # "\0tag\0" first: no namespace starts with NUL, so no tag's text is a key's text.
    digest = hmac.new(secret, f"\x00tag\x00{tag}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest[:16]).decode().rstrip("=")
