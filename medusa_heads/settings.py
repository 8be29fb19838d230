"""Settings dataclasses whose fields carry their own help (and choices), so that the command line is generated
from them: one definition of each setting, its default and its help, for the library, the CLI and the server."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, field, fields
from typing import Any


def setting(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A dataclass field with its help text (and allowed values)."""
    return field(default=default, metadata={"help": help, "choices": choices})


def describe(cls: type, name: str) -> str:
    """A setting's help text, with its default."""
    setting_ = next(f for f in fields(cls) if f.name == name)
    return f"{setting_.metadata['help']} (default: {setting_.default})"


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One option per field of the settings dataclass cls: --name-with-dashes, its type, default, choices and
    help from the field; a boolean that defaults to False is a switch, one that defaults to True gets --no-NAME."""
    for f in fields(cls):
        if f.default is MISSING:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            if f.default:
                parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                    help=f"do not: {f.metadata['help']}")
            else:
                parser.add_argument(flag, action="store_true", help=f.metadata["help"])
            continue
        parser.add_argument(flag, type=type(f.default), default=f.default, choices=f.metadata.get("choices"),
                            help=describe(cls, f.name))


def from_arguments(cls: type, args: argparse.Namespace) -> Any:
    """The settings dataclass cls from parsed options (those add_arguments made, or that match its fields)."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
