"""The ``throttle-client`` command and its demo, apart from the library.

The library never imports this package: a worker that throttles its requests loads
none of it (nor ``rich``, which the live view of the demo needs: the ``cli`` extra).

- :mod:`.command`: the command line (``demo``, ``status``, ``reset``, ``top``,
  ``history``): its entry point; :mod:`.arguments` (its parser), :mod:`.status`
  (``status``, ``reset``, ``history``), :mod:`.watch` (``demo``, ``top``);
- :mod:`.demo`: crawler processes sharing one quota against a strict local API, started
  and watched; its parts: :mod:`.settings` (its settings, store and run record, which
  the others read), :mod:`.crawler` (the crawler processes), :mod:`.judge` (how a run is
  judged), :mod:`.summary` (its progress lines and summary);
- :mod:`.top`: the keys of a store nearest their limits, read from their cards;
- :mod:`.live`: the live views of the demo and of ``top``, with rich (the only module
  that imports it);
- :mod:`.upstream`: that API, :class:`~throttle_client.cli.upstream.StrictUpstream`.
"""

from .command import main

__all__ = ["main"]
