"""Backend registry: names map to classes found through entry points.

Backends (the built-ins too) are declared in the ``kvxfer.backends`` entry-point group
of their distribution's metadata, so a third-party package adds one without touching
kvxfer::

    [project.entry-points."kvxfer.backends"]
    mybackend = "mypkg.backend:MyBackend"

Classes are imported on first use; an ``ImportError`` of an optional dependency turns
into :class:`~kvxfer.errors.MissingDependency` with the ``pip install`` hint.
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import EntryPoint, entry_points

from kvxfer.backend import BACKEND_API_VERSION, Backend
from kvxfer.errors import BackendError, BackendNotFound, DuplicateBackend, MissingDependency

__all__ = ["available_backends", "get_backend", "register_backend"]

GROUP = "kvxfer.backends"

# Which extra brings the dependency a built-in backend needs.
_EXTRAS: dict[str, str] = {"ucx": "nixl", "host_bounce": "nixl", "nixl_rbln": "nixl"}

_lock = threading.Lock()
_manual: dict[str, str | type[Backend]] = {}
_cache: dict[str, type[Backend]] = {}


def _entry_points() -> dict[str, EntryPoint]:
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        prior = found.get(ep.name)
        # The same distribution can be seen twice (e.g. an editable install plus a
        # stale egg-info); only distinct targets are a real conflict.
        if prior is not None and prior.value != ep.value:
            raise DuplicateBackend(
                f"backend name {ep.name!r} is claimed twice: {prior.value!r} and {ep.value!r}; "
                "uninstall one of the packages"
            )
        found[ep.name] = ep
    return found


def register_backend(name: str, target: str | type[Backend], *, clobber: bool = False) -> None:
    """Register a backend at run time (tests, plug-ins loaded without metadata).

    Args:
        name: Backend name used in configs.
        target: The class, or a ``"module:Class"`` path imported on first use.
        clobber: Replace an existing registration instead of raising.
    """
    with _lock:
        if not clobber and (name in _manual or name in _entry_points()):
            raise DuplicateBackend(f"backend name {name!r} is already registered")
        _manual[name] = target
        _cache.pop(name, None)


def available_backends() -> list[str]:
    """Names of every registered backend (not imported)."""
    return sorted({*_entry_points(), *_manual})


def _load(name: str, target: str | type[Backend]) -> type[Backend]:
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except MissingDependency:
        raise
    except ImportError as exc:
        extra = _EXTRAS.get(name, name)
        raise MissingDependency(
            f"backend {name!r} needs a dependency that is not installed ({exc}); "
            f"install it with: pip install 'kvxfer[{extra}]'"
        ) from exc
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendError(f"backend {name!r}: {target!r} is not a kvxfer Backend subclass")
    return cls


def get_backend(name: str) -> type[Backend]:
    """Return the backend class registered as ``name``.

    Raises:
        BackendNotFound: no backend of that name (the message lists the known ones).
        MissingDependency: its optional dependency is missing (with the install hint).
        BackendError: it declares another backend API version.
    """
    with _lock:
        cached = _cache.get(name)
        if cached is not None:
            return cached
        target: str | type[Backend] | None = _manual.get(name)
        if target is None:
            ep = _entry_points().get(name)
            target = ep.value if ep is not None else None
        if target is None:
            known = ", ".join(sorted({*_entry_points(), *_manual})) or "none"
            raise BackendNotFound(f"no kvxfer backend named {name!r}; known backends: {known}")
        cls = _load(name, target)
        if getattr(cls, "api_version", None) != BACKEND_API_VERSION:
            raise BackendError(
                f"backend {name!r} implements backend API version "
                f"{getattr(cls, 'api_version', None)!r}; this kvxfer needs {BACKEND_API_VERSION}"
            )
        _cache[name] = cls
        return cls
