"""Command lines of the project. One way to report a bad one, shared by every command (the peers' flags, the demo,
the auth tool): a single ``prog: error: message`` line and exit status 2, instead of argparse's usage block (which
``--help`` still shows in full); and the peers' flags built from their settings dataclasses (:class:`SettingsParser`).
Cheap to import: argparse and the standard library only."""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Literal, NoReturn, Optional, Sequence, Union


class OneLineErrors:
    """Mixed in front of an ``argparse.ArgumentParser`` (or a subclass)."""

    prog: str

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class OneLineErrorParser(OneLineErrors, argparse.ArgumentParser):
    """A plain ``argparse.ArgumentParser`` with one-line errors."""


class SettingsParser(OneLineErrors, argparse.ArgumentParser):
    """A command line built from settings dataclasses (:mod:`lean_transformer.swarm.protocol.settings` and the
    application's own): one flag per field, named after it, with its ``help`` metadata and default; one argument group
    per dataclass (its ``_argument_group_name``). ``bool`` fields take ``--flag`` alone or ``--flag true/false``
    (and ``--no_flag`` when they default to true), lists take one or more values, ``Literal`` fields their choices.

    Written here rather than taken from ``transformers.HfArgumentParser`` so that parsing flags (``--help``, a typo)
    loads neither transformers nor torch."""

    def __init__(self, dataclass_types: Sequence[type], description: Optional[str] = None):
        super().__init__(description=description, formatter_class=_HelpFormatter)
        self.dataclass_types = list(dataclass_types)
        for dataclass_type in self.dataclass_types:
            group = self.add_argument_group(getattr(dataclass_type, "_argument_group_name", dataclass_type.__name__))
            hints = typing.get_type_hints(dataclass_type)
            for item in dataclasses.fields(dataclass_type):
                if item.init:
                    _add_flag(group, item, hints[item.name])

    def parse_into(self, argv: Optional[Sequence[str]] = None) -> tuple:
        """One instance of each dataclass; a bad value (argparse's or a field check's ``ValueError``) exits with one
        line on stderr and status 2."""
        namespace = vars(self.parse_args(argv))
        try:
            return tuple(dataclass_type(**{item.name: namespace[item.name]
                                           for item in dataclasses.fields(dataclass_type) if item.init})
                         for dataclass_type in self.dataclass_types)
        except ValueError as e:
            self.error(str(e))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Show defaults, keep the description's line breaks."""


def _to_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "yes", "1", "y", "t"):
        return True
    if value in ("false", "no", "0", "n", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _add_flag(group: argparse._ArgumentGroup, item: dataclasses.Field, hint: Any) -> None:
    options: dict[str, Any] = dict(help=item.metadata.get("help"))
    if item.default is not dataclasses.MISSING:
        options["default"] = item.default
    elif item.default_factory is not dataclasses.MISSING:
        options["default"] = item.default_factory()
    else:
        options["required"] = True
    arguments = [value for value in typing.get_args(hint) if value is not type(None)]
    if typing.get_origin(hint) is Union:  # Optional[X]
        hint = arguments[0]
    if hint is bool:
        options.update(nargs="?", const=True, type=_to_bool, metavar="{true,false}")
    elif typing.get_origin(hint) is Literal:
        choices = list(typing.get_args(hint))
        options.update(choices=choices, type=type(choices[0]))
    elif typing.get_origin(hint) is list:
        options.update(nargs="+", type=typing.get_args(hint)[0])
    else:
        options["type"] = hint
    group.add_argument(f"--{item.name}", **options)
    if hint is bool and options.get("default") is True:
        group.add_argument(f"--no_{item.name}", dest=item.name, action="store_false", help=argparse.SUPPRESS)
