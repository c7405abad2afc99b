"""``python -m throttle_client``: the ``throttle-client`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
