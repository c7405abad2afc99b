"""The exceptions that throttle_client raises.

ThrottleError
├── ThrottleTimeout        the slot is further away than the caller will wait
├── BackendError           the store answered with an error (wrong key type, bad script)
│   └── BackendUnavailable the store could not be reached (wraps the driver's error)
└── ConfigurationError     also a ValueError: a bad rate, interval, cost or namespace
    └── CostTooHigh        a cost that no window could ever hold
"""

from __future__ import annotations


def shed_frames(exc: BaseException | None) -> None:
    """Drop the tracebacks of ``exc`` and of the errors it was raised from or while
    handling. A traceback holds the frames its error passed through, the caller's
    limiter among them, and a frame that holds the error (or the limiter, which holds
    its last error) closes a cycle: the limiter and its connections would live on until
    the collector runs. Only for an error that no one will raise again."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


class ThrottleError(Exception):
    """Root of every error this library raises on purpose."""


class ThrottleTimeout(ThrottleError):
    """The earliest slot lies further away than ``timeout``; nothing was recorded but
    the slots ``late_wakeups`` counts.

    ``retry_after`` is the number of seconds after which the same call would have
    been admitted at the moment it was refused. ``late_wakeups``: slots the call booked
    and left unused: each one it woke too late for, and one the store found within the
    timeout that the call could only reach past it (a slow first connection).
    """

    def __init__(
        self, retry_after: float, message: str | None = None, *, late_wakeups: int = 0
    ) -> None:
        self.retry_after = retry_after
        self.late_wakeups = late_wakeups  # slots it booked and left unused
        super().__init__(message or f"no slot within the timeout; retry after {retry_after:.3f}s")


class BackendError(ThrottleError):
    """The store answered with an error; the driver's exception is the ``__cause__``.

    Never a reason to let a call through: a key of the wrong type stays an error.
    """


class BackendUnavailable(BackendError):
    """The store did not answer; the driver's exception is the ``__cause__``."""


class ConfigurationError(ThrottleError, ValueError):
    """A value the limiter cannot work with. The message names the value."""


class CostTooHigh(ConfigurationError):
    """A cost larger than a rate's limit: it could never be admitted, so it fails at once."""
