"""``python -m throttle_client``: the ``throttle-client`` command."""

from ._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
