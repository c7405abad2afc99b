"""Keep ``__all__`` honest (as httpx's tests/test_exported_members.py does)."""

from __future__ import annotations
import __future__

import subprocess
import sys
import types

import pytest

import throttle_client
import throttle_client.testing

INCLUDED_PRIVATE_MEMBERS = ["__version__"]


def public_names(module: types.ModuleType) -> list[str]:
    for name in module.__all__:  # (a name loaded on first use, the Redis backends, now)
        getattr(module, name)
    return [
        name
        for name, value in vars(module).items()
        if (not name.startswith("_") or name in INCLUDED_PRIVATE_MEMBERS)
        # Neither submodules (``throttle_client.testing`` once imported) nor
        # ``from __future__ import annotations`` are exports.
        and not isinstance(value, (types.ModuleType, __future__._Feature))
    ]


@pytest.mark.parametrize("module", [throttle_client, throttle_client.testing], ids=str)
def test_all_is_sorted_and_lists_every_public_name(module: types.ModuleType) -> None:
    assert module.__all__ == sorted(module.__all__)
    assert sorted(module.__all__) == sorted(public_names(module))


def test_importing_the_package_loads_no_redis_client() -> None:
    """A worker on memory or SQLite never loads redis-py; the first use of a Redis
    backend's name does."""
    code = (
        "import sys, throttle_client\n"
        "from throttle_client import Limiter, MemoryBackend, SQLiteBackend, ThrottledTransport\n"
        "Limiter(MemoryBackend(), rates=['1/second']).try_acquire('k')\n"
        "assert 'redis' not in sys.modules, sorted(m for m in sys.modules if 'redis' in m)\n"
        "from throttle_client import RedisBackend\n"
        "assert 'redis' in sys.modules and RedisBackend.__module__.endswith('redis')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NoSuchBackend"):
        throttle_client.NoSuchBackend  # noqa: B018


def test_every_exported_class_and_function_has_a_docstring() -> None:
    undocumented = [
        name
        for name in throttle_client.__all__
        if callable(getattr(throttle_client, name)) and not getattr(throttle_client, name).__doc__
    ]
    assert undocumented == []


def test_the_moved_strict_upstream_still_imports_from_testing_with_a_warning() -> None:
    from throttle_client.cli.upstream import StrictUpstream

    with pytest.warns(DeprecationWarning, match=r"throttle_client\.cli\.upstream"):
        from throttle_client.testing import StrictUpstream as old

    assert old is StrictUpstream
    with pytest.raises(AttributeError, match="NoSuchName"):
        throttle_client.testing.NoSuchName  # noqa: B018
