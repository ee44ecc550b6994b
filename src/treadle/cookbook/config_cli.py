"""Recipes take `--key value` flags generated from their config dataclass."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any, TypeVar

C = TypeVar("C")


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _scalar_type(annotation: Any) -> Any:
    """The parser for a field's type; `X | None` parses as X ("none" gives None)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)][0]
        parse = _scalar_type(inner)
        return lambda s: None if s.lower() == "none" else parse(s)
    return {bool: _parse_bool, int: int, float: float}.get(annotation, str)


def parse_config(cls: type[C], argv: list[str] | None = None, description: str = "") -> C:
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(cls):
        if hints[f.name] is dict or typing.get_origin(hints[f.name]) is dict:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        parser.add_argument(
            f"--{f.name}",
            type=_scalar_type(hints[f.name]),
            required=required,
            default=None if required else f.default,
            help=f"(default: {f.default})" if not required else "(required)",
        )
    return cls(**vars(parser.parse_args(argv)))
