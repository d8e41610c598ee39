"""One name -> plug-in table for every plug-in point: models, attacks, protocols' study steps,
model sources, datasets, corruptions and importers.

    >>> ATTACKS = Registry("attack", package="robust_attn.attacks", error=AttackInputError)
    >>> @ATTACKS.add("pgd")                  # a decorator: the object itself is the entry
    ... class PGD: ...
    >>> ATTACKS.register("fgsm", FGSM)       # or an entry built by the caller
    >>> ATTACKS.get("pgdd")                  # AttackInputError: unknown attack 'pgdd'. Did you mean 'pgd'? ...
    >>> ATTACKS.names()                      # sorted

A registry with a ``package`` imports every module of that package (``pkgutil``, modules whose
name starts with ``_`` excepted) the first time it is asked for an entry, so a new plug-in is one
new file in the package, and no list of plug-ins is kept by hand anywhere. Registering a name
twice is an error.
"""
from __future__ import annotations

import difflib
import importlib
import pkgutil
from typing import Callable, Generic, Iterator, TypeVar

__all__ = ["Registry", "discover"]

T = TypeVar("T")


def discover(package: str) -> list[str]:
    """Import every module of ``package`` (not its ``_private`` ones); their names, in import order."""
    pkg = importlib.import_module(package)
    names = [info.name for info in pkgutil.iter_modules(pkg.__path__) if not info.name.startswith("_")]
    for name in names:
        importlib.import_module(f"{package}.{name}")
    return names


class Registry(Generic[T]):
    """Plug-ins of one ``kind`` by name.

    ``package``: the package (or packages) whose modules register themselves (imported on first use);
    ``error``: the exception an unknown name raises (its message names the closest names and all
    names); ``hint``: a sentence appended to that message (e.g. the command that lists them)."""

    def __init__(self, kind: str, package: str | tuple[str, ...] | None = None, *,
                 error: type[Exception] = KeyError, hint: str = ""):
        self.kind, self.error, self.hint = kind, error, hint
        self.packages = (package,) if isinstance(package, str) else tuple(package or ())
        self._entries: dict[str, T] = {}
        self._discovered = package is None

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name``; a second entry of the same name is a ``ValueError``."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def remove(self, name: str) -> T:
        """Take ``name`` out (e.g. a plug-in a test registered); its entry."""
        return self._entries.pop(name)

    def add(self, name: str | None = None) -> Callable[[T], T]:
        """Decorator registering the decorated object under ``name`` (default: its ``__name__``)."""

        def wrap(obj: T) -> T:
            return self.register(name or obj.__name__, obj)

        return wrap

    def discover(self) -> None:
        """Import the package's modules once, so that their registrations have run."""
        if not self._discovered:
            self._discovered = True   # before importing: a module may ask for entries while it loads
            for package in self.packages:
                discover(package)

    def names(self) -> list[str]:
        """Every registered name, sorted."""
        self.discover()
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        """``(name, entry)`` in registration order."""
        self.discover()
        return iter(list(self._entries.items()))

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        self.discover()
        return name in self._entries

    def __len__(self) -> int:
        self.discover()
        return len(self._entries)

    def close_matches(self, name: str, n: int = 1, cutoff: float = 0.6) -> list[str]:
        self.discover()
        return difflib.get_close_matches(name, self._entries, n=n, cutoff=cutoff)

    def unknown(self, name: str, n: int = 1, cutoff: float = 0.6) -> Exception:
        """The error of an unknown ``name``: the closest names, then all of them."""
        close = self.close_matches(name, n, cutoff)
        did_you_mean = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        hint = f" {self.hint}" if self.hint else ""
        return self.error(f"unknown {self.kind} {name!r}.{did_you_mean} Choose one of {', '.join(self.names())}."
                          f"{hint}")

    def get(self, name: str) -> T:
        """The entry of ``name``; an unknown name raises ``error`` with the closest names."""
        self.discover()
        if name not in self._entries:
            raise self.unknown(name)
        return self._entries[name]
