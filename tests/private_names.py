"""A guard that records every private name of the library that code of the command's
package (``throttle_client.cli``) touches while it runs: a name with one leading
underscore (not a dunder) of the library's public classes, of its modules, or imported
from it, and a private hook of the library that a class of the command overrides.

It watches what runs, not what the source says:

- an attribute read on an instance of a public class (``throttle_client.__all__``, and
  the classes of the public modules ``plot`` and ``testing``): each class gets a
  ``__getattribute__`` that looks at the module of the code reading it
  (``sys._getframe(1)``);
- an attribute read on a module of the library (each becomes a guarded module);
- an import by the command (``builtins.__import__``): a private module of the library,
  or a name of ``throttle_client`` outside ``__all__`` (a private name taken from a
  module is a read of the module's attribute, above);
- the library reading a private attribute that a class of the command defines: an
  override of a private hook (``Limiter._perform`` wrapped in a subclass), which the
  override's own ``super()._perform(...)`` would not show.

``install(report)`` starts it and returns the function that stops it; what it finds is
appended to ``found`` and, one line each, to the file ``report``. Set
``PRIVATE_NAMES_REPORT`` to a path and import this module from a ``sitecustomize`` to
guard every process of a run, the demo's spawned crawlers included.
"""

from __future__ import annotations

import builtins
import importlib.util
import os
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

REPORT_ENV = "PRIVATE_NAMES_REPORT"
found: list[str] = []
_report: Path | None = None


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def is_command(module: str) -> bool:
    return module == "throttle_client.cli" or module.startswith("throttle_client.cli.")


def is_library(module: str) -> bool:
    return (module == "throttle_client" or module.startswith("throttle_client.")) and not (
        is_command(module)
    )


def _record(frame: types.FrameType, what: str) -> None:
    where = f"{frame.f_globals.get('__name__')}:{frame.f_lineno}"
    line = f"{where}: {what}"
    found.append(line)
    if _report is not None:
        with _report.open("a") as out:
            out.write(line + "\n")


def _module_of(frame: types.FrameType) -> str:
    name = frame.f_globals.get("__name__", "")
    return name if isinstance(name, str) else ""


# -- instances of the library's public classes -------------------------------------------------

_command_classes: dict[type, tuple[type, ...]] = {}


def _command_part(cls: type) -> tuple[type, ...]:
    """The classes of the command in ``cls``'s MRO (a subclass the command made)."""
    part = _command_classes.get(cls)
    if part is None:
        part = _command_classes[cls] = tuple(
            k for k in cls.__mro__ if is_command(getattr(k, "__module__", ""))
        )
    return part


def _defined_by(cls: type, name: str) -> type | None:
    return next((k for k in cls.__mro__ if name in vars(k)), None)


def _check_attribute(obj: object, name: str, frame: types.FrameType) -> None:
    reader = _module_of(frame)
    cls = type(obj)
    ours = _command_part(cls)
    if is_command(reader):
        if ours:
            # A subclass the command made: its own names are its business, the
            # library's are not.
            owner = _defined_by(cls, name)
            if owner is None or owner in ours:
                return
        _record(frame, f"reads {cls.__name__}.{name}")
    elif ours and is_library(reader):
        owner = _defined_by(cls, name)
        if owner is not None and owner in ours:
            _record(frame, f"the library reads {name}, which the command's {owner.__name__} "
                           "defines over the library's own")  # fmt: skip


def _guard_class(cls: type, undo: list[Callable[[], None]]) -> None:
    if getattr(cls.__getattribute__, "guards_private_names", False):
        return  # a subclass of a guarded class, with no __getattribute__ of its own
    had = "__getattribute__" in vars(cls)
    before = vars(cls).get("__getattribute__")
    inherited = cast(Callable[[object, str], Any], cls.__getattribute__)

    def __getattribute__(self: object, name: str) -> Any:
        if name[:1] == "_" and name[:2] != "__":
            _check_attribute(self, name, sys._getframe(1))
        return inherited(self, name)

    __getattribute__.guards_private_names = True  # type: ignore[attr-defined]
    type.__setattr__(cls, "__getattribute__", __getattribute__)

    def restore() -> None:
        if had:
            type.__setattr__(cls, "__getattribute__", before)
        else:
            type.__delattr__(cls, "__getattribute__")

    undo.append(restore)


def public_classes() -> list[type]:
    """The classes a user of the library is given: ``throttle_client.__all__`` and those
    of its public modules, base classes first (a subclass's guard is found first)."""
    import throttle_client
    import throttle_client.testing

    modules: list[tuple[types.ModuleType, Sequence[str]]] = [
        (throttle_client, throttle_client.__all__),
        (throttle_client.testing, [n for n in vars(throttle_client.testing) if n[:1] != "_"]),
    ]
    if "matplotlib" in sys.modules or importlib.util.find_spec("matplotlib") is not None:
        import throttle_client.plot

        modules.append((throttle_client.plot, throttle_client.plot.__all__))
    classes = {
        value
        for module, names in modules
        for value in (getattr(module, name) for name in names)
        if isinstance(value, type) and is_library(value.__module__)
    }
    return sorted(classes, key=lambda cls: len(cls.__mro__))


# -- modules and imports ----------------------------------------------------------------------


class _GuardedModule(types.ModuleType):
    def __getattribute__(self, name: str) -> Any:
        if name[:1] == "_" and name[:2] != "__":
            frame = sys._getframe(1)
            if is_command(_module_of(frame)):
                module = types.ModuleType.__getattribute__(self, "__name__")
                _record(frame, f"reads {module}.{name}")
        return types.ModuleType.__getattribute__(self, name)


def _guard_modules(undo: list[Callable[[], None]], done: set[str]) -> None:
    for name, module in list(sys.modules.items()):
        if name in done or not is_library(name) or type(module) is not types.ModuleType:
            continue
        done.add(name)
        module.__class__ = _GuardedModule

        def restore(module: types.ModuleType = module) -> None:
            module.__class__ = types.ModuleType

        undo.append(restore)


def _check_import(
    frame: types.FrameType,
    name: str,
    importer: Mapping[str, Any],
    fromlist: Sequence[str] | None,
    level: int,
) -> None:
    target = importlib.util.resolve_name("." * level + name, importer.get("__package__") or "")
    if not is_library(target):
        return
    if any(is_private(part) for part in target.split(".")):
        _record(frame, f"imports {target}")
        return
    import throttle_client

    # A private name taken from a module ("from throttle_client import _rate") is read
    # from the guarded module by the importing code itself: the module guard reports it.
    if target != "throttle_client":
        return
    for item in fromlist or ():
        # (A public module, "from throttle_client import plot", is public.)
        value = getattr(sys.modules.get(target), item, None)
        if is_private(item) or item in throttle_client.__all__:
            continue
        if not isinstance(value, types.ModuleType):
            _record(frame, f"imports {item} from {target}, which is not in its __all__")


# -- installing ---------------------------------------------------------------------------------


def install(report: str | os.PathLike[str] | None = None) -> Callable[[], None]:
    """Start guarding; returns the function that stops it."""
    global _report
    _report = None if report is None else Path(report)
    undo: list[Callable[[], None]] = []
    for cls in public_classes():
        _guard_class(cls, undo)
    done: set[str] = set()
    _guard_modules(undo, done)
    known = [len(sys.modules)]  # modules loaded when they were last looked through
    original_import = builtins.__import__

    def guarded_import(
        name: str,
        globals: Mapping[str, Any] | None = None,
        locals: Mapping[str, Any] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> types.ModuleType:
        module = original_import(name, globals, locals, fromlist, level)
        if globals is not None and is_command(str(globals.get("__name__", ""))):
            _check_import(sys._getframe(1), name, globals, fromlist, level)
        if len(sys.modules) != known[0]:  # (most imports load nothing new)
            _guard_modules(undo, done)
            known[0] = len(sys.modules)
        return module

    builtins.__import__ = guarded_import

    def uninstall() -> None:
        builtins.__import__ = original_import
        for restore in reversed(undo):
            restore()

    return uninstall


if os.environ.get(REPORT_ENV):
    install(os.environ[REPORT_ENV])
    with open(os.environ[REPORT_ENV] + ".processes", "a") as processes:
        processes.write(f"{os.getpid()}\n")  # each process guarded, the spawned ones too
