"""One registry mechanism for every pluggable piece: estimators, losses, rollout engines, scorers, reward managers.

A registry maps names to entries. An entry is registered in code (``REG.add("name", obj)``, usually through a
decorator) or named by an import path in the config, so that a user's plugin reaches the Ray workers without patching
hybridflow: any name of the form ``package.module:attr`` (or ``path/to/file.py:attr``) is imported on first lookup,
in whichever process looks it up.

    ADVANTAGE_ESTIMATORS.get("grpo")                       # registered by hybridflow
    ADVANTAGE_ESTIMATORS.get("my_pkg.estimators:my_adv")   # imported, wrapped, cached under that name

Entries may also be registered lazily as an import-path string (``add("vllm", "hybridflow...:VLLMRollout",
lazy=True)``): the import happens when the name is first asked for, so optional backends cost nothing until used.
Duplicate names are an error unless ``override=True``. This module imports nothing from hybridflow.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["PluginError", "Registry", "import_file", "import_object", "is_import_path"]


class PluginError(ValueError):
    """A plugin name could not be resolved, or a registration conflicts; the message says what to change."""


def is_import_path(name: str) -> bool:
    """True for 'package.module:attr' and 'path/to/file.py:attr'."""
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr and attr.isidentifier())


def import_object(path: str, *, what: str = "plugin", advice: str | None = None) -> Any:
    """The object named by 'package.module:attr' or 'path/to/file.py:attr' (the file is imported as a module once).

    advice: what to tell the user when the module cannot be imported (default: how to make a plugin importable).
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"{what} {path!r} is not an import path of the form 'package.module:attr'")
    if module_name.endswith(".py") or os.sep in module_name:
        module = import_file(os.path.expanduser(module_name), what=what)
    else:
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            advice = advice or (
                "make it importable in every process (install the package, or put its folder on PYTHONPATH), or "
                "name a file 'path/to/file.py:attr'"
            )
            raise PluginError(f"{what} could not be imported ({err}); {advice}") from err
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            raise PluginError(f"{what} {path!r}: {module_name} has no attribute {attr!r}; it defines {public}")
        obj = getattr(obj, part)
    return obj


def import_file(path: str, *, what: str = "plugin"):
    """The module of the Python file at `path`, imported once per process under a name unique to the file (two
    users' files both called reward.py do not clash). PluginError naming the file if it is missing or fails."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise PluginError(f"{what}: file {path} does not exist")
    module_name = "hybridflow_plugin_" + "".join(c if c.isalnum() else "_" for c in path)
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"{what}: {path} cannot be imported as a Python module; use a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[module_name]
        raise PluginError(f"{what}: {path} failed to import: {type(e).__name__}: {e}") from e
    return module


class Registry(Generic[T]):
    """Named entries of one kind, with import-path plugins and lazily imported entries.

    kind: what the entries are, for messages ("advantage estimator"). register_hint: how to add one
    ("@register_advantage"). coerce: turns what an import path names into an entry (e.g. wraps a plain function);
    it is also applied to lazily registered entries when they are imported. install_hints: name -> what to install
    when a lazy entry fails to import.
    """

    def __init__(
        self,
        kind: str,
        register_hint: str,
        *,
        coerce: Callable[[str, Any], T] | None = None,
        install_hints: dict[str, str] | None = None,
    ):
        self.kind = kind
        self.register_hint = register_hint
        self.coerce = coerce
        self.install_hints = dict(install_hints or {})
        self._entries: dict[str, T] = {}
        self._lazy: dict[str, str] = {}

    def add(self, name: str, entry: T | str, *, override: bool = False, lazy: bool = False) -> None:
        """Register `entry` as `name`; with lazy=True, `entry` is an import path imported on first use."""
        if not isinstance(name, str) or not name:
            raise PluginError(f"a {self.kind} name must be a non-empty string, got {name!r}")
        if name in self and not override:
            current = self._lazy.get(name) or self._entries.get(name)
            raise PluginError(
                f"{self.kind} {name!r} is already registered ({current!r}); pick another name, or pass "
                "override=True to replace it"
            )
        self._entries.pop(name, None)
        self._lazy.pop(name, None)
        if lazy:
            if not isinstance(entry, str) or not is_import_path(entry):
                raise PluginError(f"lazy {self.kind} {name!r} needs an import path 'package.module:attr', got {entry!r}")
            self._lazy[name] = entry
        else:
            self._entries[name] = entry

    def remove(self, name: str) -> T | str:
        """Unregister `name` and return its entry (for tests and notebooks that register throw-away entries)."""
        if name in self._lazy:
            return self._lazy.pop(name)
        self.get(name)  # raises the helpful error for unknown names
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        """The entry registered as `name`, importing it first if it is lazy or an import path."""
        if name in self._entries:
            return self._entries[name]
        if name in self._lazy:
            entry = self._import(name, self._lazy[name], hint=self.install_hints.get(name))
            self._lazy.pop(name)
            self._entries[name] = entry
            return entry
        if isinstance(name, str) and is_import_path(name):
            entry = self._import(name, name)
            self._entries[name] = entry
            return entry
        raise PluginError(self.unknown_message(name))

    def _import(self, name: str, path: str, hint: str | None = None) -> T:
        obj = import_object(path, what=f"{self.kind} {name!r}", advice=hint or (None if name == path else (
            f"check that the package it needs is installed ({path})")))
        return self.coerce(name, obj) if self.coerce else obj

    def unknown_message(self, name: Any) -> str:
        known = self.names()
        close = difflib.get_close_matches(str(name), known, n=2, cutoff=0.6)
        maybe = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
        return (
            f"unknown {self.kind} {name!r}; known: {', '.join(known) or '(none)'}.{maybe} Fix the name in your "
            f"config, name your own as 'package.module:attr', or register one with {self.register_hint}"
        )

    def check(self, name: str) -> str | None:
        """None when `name` resolves (importing it if needed), else the error message; for config validation."""
        try:
            self.get(name)
        except PluginError as err:
            return str(err)
        return None

    def names(self) -> list[str]:
        """Sorted registered names (lazy ones included; import paths resolved so far included)."""
        return sorted({*self._entries, *self._lazy})

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._lazy

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
