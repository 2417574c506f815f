"""Logits processors named on the command line ("module:Class" or "module.Class") or passed as
classes to LLM: resolved to classes, and built once per runner."""

from __future__ import annotations

import importlib
from typing import Any

PROCESSOR_METHODS = ("is_argmax_invariant", "update_state", "apply")


def parse_specs(value: str | list | tuple | None) -> tuple:
    """--logits-processors "a:A,b:B" (or a list of names and classes) -> a tuple of names and
    classes, unresolved (the engine core imports them)."""
    if value is None:
        return ()
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    for item in items:
        if not isinstance(item, (str, type)) or (isinstance(item, str) and not item):
            raise ValueError(f"logits_processors: each is a class or 'module:Class', got {item!r}")
    return tuple(items)


def resolve_class(spec: str | type) -> type:
    """The class a spec names; ValueError if it cannot be imported or is no logits processor."""
    if isinstance(spec, type):
        cls = spec
    else:
        module_name, sep, name = spec.partition(":")
        if not sep:
            module_name, _, name = spec.rpartition(".")
        if not module_name or not name:
            raise ValueError(f"logits_processors: {spec!r} is not 'module:Class'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(f"logits_processors: cannot import {module_name!r} ({e})") from e
        cls = getattr(module, name, None)
        if not isinstance(cls, type):
            raise ValueError(f"logits_processors: {module_name!r} has no class {name!r}")
    missing = [m for m in PROCESSOR_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"logits_processors: {cls.__qualname__} is not a logits processor (no {', '.join(missing)})")
    return cls


def resolve_classes(specs: tuple) -> list[type]:
    return [resolve_class(spec) for spec in specs]


def build_processors(specs: tuple, config: Any, device: Any) -> list[Any]:
    """One instance of each, as vLLM builds them: (config, device, is_pin_memory)."""
    return [cls(config, device, False) for cls in resolve_classes(specs)]


def validate_params(classes: list[type], params: Any) -> None:
    """Each processor's own check of a request's arguments (ValueError)."""
    for cls in classes:
        check = getattr(cls, "validate_params", None)
        if check is not None:
            check(params)
