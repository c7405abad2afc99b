"""Griffe extension: the docstrings' reStructuredText roles, as Markdown.

The package's docstrings are read in terminals and IDEs as often as on the site, and
name other objects the Sphinx way (``:class:`~throttle_client.History```); the site
shows each as code (``History``).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:meth|class|func|attr|data|exc|mod|obj):`(~?)([^`]+)`")


def _markdown(text: str) -> str:
    def code(match: re.Match[str]) -> str:
        short, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if short else target}`"

    return _ROLE.sub(code, text).replace("\\ ", "")


class RolesAsCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _markdown(obj.docstring.value)
