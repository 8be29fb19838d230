"""Settings dataclasses whose fields carry their own help (and choices) in the metadata that transformers'
`HfArgumentParser` reads: one definition of each setting, its default and its help, for the library, the
command line (generated from the dataclasses) and the server."""

from __future__ import annotations

import argparse
from dataclasses import field, fields
from typing import Any


def setting(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A dataclass field with its help text (and allowed values)."""
    return field(default=default, metadata={"help": help} | ({"choices": choices} if choices else {}))


def describe(cls: type, name: str) -> str:
    """A setting's help text, with its default (cls() holds every default)."""
    help = next(f.metadata["help"] for f in fields(cls) if f.name == name)
    return f"{help} (default: {getattr(cls(), name)})"


def from_arguments(cls: type, args: argparse.Namespace) -> Any:
    """The settings dataclass cls from parsed options (those of its fields that args has)."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
