"""``Registry``: names -> plug-ins of one kind (proposers, attention backends, target architectures).

Three sources, in this order of precedence:

- names registered in the running process with :meth:`Registry.register`;
- the package's built-ins, given as ``"module:attr"`` strings and imported on first use, so a plug-in's
  dependencies load only when it is chosen;
- entry points of installed distributions in the registry's group (``[project.entry-points."GROUP"]``
  ``name = "pkg.module:attr"``), read with :mod:`importlib.metadata` the first time a name is looked up
  or listed. An entry point never shadows a built-in or a registered name (it is skipped with a warning).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings
from typing import Generic, Mapping, TypeVar, Union

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A name no source of the registry provides; the message lists the valid choices."""


def resolve(target: str) -> object:
    """Import ``"pkg.module:attr"`` (``attr`` may be dotted) and return the object."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected 'module:attr', got {target!r}")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class Registry(Generic[T]):
    """Plug-ins of one ``kind`` by name; see the module docstring for where names come from.

    ``missing`` is the message for an unknown name, formatted with ``kind``, ``name`` (its repr) and
    ``choices`` (the valid names, comma-separated).
    """

    def __init__(
        self,
        kind: str,
        group: str,
        builtins: Mapping[str, str],
        *,
        missing: str = "unknown {kind} {name}; choose one of: {choices}",
    ):
        self.kind = kind
        self.group = group
        self._builtins = dict(builtins)
        self._registered: dict[str, Union[str, T]] = {}
        self._entry_points: dict[str, importlib.metadata.EntryPoint] | None = None
        self._loaded: dict[str, T] = {}
        self._missing = missing

    def register(self, name: str, target: Union[str, T]) -> None:
        """Make ``target`` (an object, or ``"module:attr"`` imported on first use) selectable as ``name``.

        A registered name replaces a built-in or installed one of the same name in this process.
        """
        if not (isinstance(name, str) and name):
            raise ValueError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        self._registered[name] = target
        self._loaded.pop(name, None)

    def unregister(self, name: str) -> None:
        """Forget a name registered in this process (built-ins and installed names stay)."""
        self._registered.pop(name, None)
        self._loaded.pop(name, None)

    def names(self) -> list[str]:
        """Every selectable name, sorted."""
        return sorted({*self._builtins, *self._registered, *self._installed()})

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._registered or name in self._builtins or name in self._installed())

    def get(self, name: str) -> T:
        """The plug-in called ``name``, imported on first use; :class:`UnknownNameError` lists the choices."""
        if name in self._loaded:
            return self._loaded[name]
        if name in self._registered:
            target = self._registered[name]
        elif isinstance(name, str) and name in self._builtins:
            target = self._builtins[name]
        elif isinstance(name, str) and name in self._installed():
            target = self._installed()[name].load()
        else:
            raise UnknownNameError(self.unknown_message(name))
        value = resolve(target) if isinstance(target, str) else target
        self._loaded[name] = value  # type: ignore[assignment]
        return value  # type: ignore[return-value]

    def unknown_message(self, name: object) -> str:
        return self._missing.format(kind=self.kind, name=repr(name), choices=", ".join(self.names()))

    def _installed(self) -> dict[str, importlib.metadata.EntryPoint]:
        if self._entry_points is None:
            found: dict[str, importlib.metadata.EntryPoint] = {}
            for entry in importlib.metadata.entry_points(group=self.group):
                if entry.name in self._builtins or entry.name in self._registered:
                    warnings.warn(
                        f"{self.kind} {entry.name!r} from the installed entry point {entry.value!r} is ignored: "
                        f"the name is taken (built in or registered); rename the entry point",
                        stacklevel=3,
                    )
                    continue
                found.setdefault(entry.name, entry)
            self._entry_points = found
        return self._entry_points

    def refresh(self) -> None:
        """Read the installed entry points again (after installing a distribution in this process)."""
        self._entry_points = None

