"""A stage's own settings, declared once: flag, default, help and choices beside the field, validation in
the dataclass, and the round trip to and from a command line derived from the declaration.

A stage declares a frozen dataclass of ``option(...)`` fields (``recpipe/<stage>/spec.py``)::

    @dataclass(frozen=True)
    class RankingOptions(StageOptions):
        embeddings: str = option("device", choices=("device", "host"), help="where the DLRM tables live")

``recpipe serve`` adds every registered stage's flags to its parser (a flag that two stages share, such
as ``--cuda-graphs``, is declared once in a shared module and added once), builds each stage's options
from the parsed flags (``from_namespace``, which runs the validation), and hands a supervised stage
process the same settings back as flags (``to_argv``). Nothing here knows a stage by name.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar, TypeVar

_META = "recpipe.option"

Opts = TypeVar("Opts", bound="StageOptions")


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """How one option appears on the command line: ``--flag`` (default: the field name with dashes),
    its help text, its choices, and whether a bool takes ``--no-flag`` too."""

    help: str
    flag: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def option(default: Any, *, help: str, flag: str | None = None, choices: Sequence[str] | None = None,
           metavar: str | None = None) -> Any:
    """A dataclass field that is also a ``recpipe serve`` flag (see the module docstring)."""
    spec = OptionSpec(help, flag, tuple(choices) if choices is not None else None, metavar)
    return dataclasses.field(default=default, metadata={_META: spec})


def _flag(f: dataclasses.Field[Any]) -> str:
    spec: OptionSpec = f.metadata[_META]
    return spec.flag or "--" + f.name.replace("_", "-")


def _dest(f: dataclasses.Field[Any]) -> str:
    return _flag(f)[2:].replace("-", "_")


def _option_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if _META in f.metadata]


@dataclasses.dataclass(frozen=True)
class StageOptions:
    """Base of every stage's options dataclass. Subclasses validate in ``__post_init__`` (raising
    ``UsageError``) and may refuse a choice the machine cannot honour in ``check_machine``."""

    #: The title of the stage's group in ``recpipe serve --help``.
    group: ClassVar[str] = ""

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, seen: dict[str, Any] | None = None,
                      only: Sequence[str] = ()) -> None:
        """Add this stage's flags (``only`` these fields, if given) to ``parser``; a flag already in
        ``seen`` (declared by the same shared field of another stage) is not added twice, and one
        declared differently is an error."""
        seen = {} if seen is None else seen
        declared = [f for f in _option_fields(cls) if not only or f.name in only]
        fields = [f for f in declared if _flag(f) not in seen]
        for f in declared:
            other = seen.get(_flag(f))
            if other is not None and (other.metadata != f.metadata or other.default != f.default):
                raise TypeError(f"{_flag(f)} is declared twice, differently ({cls.__name__})")
        if not fields:
            return
        groups: dict[str, argparse._ArgumentGroup] = {}
        for f in fields:
            seen[_flag(f)] = f
            # under the group of the options class that declares it (--cuda-graphs: every torch stage's)
            owner = next(b for b in cls.__mro__ if f.name in vars(b).get("__annotations__", {}))
            title = getattr(owner, "group", "") or cls.group or cls.__name__
            group = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
            spec: OptionSpec = f.metadata[_META]
            kwargs: dict[str, Any] = {"dest": _dest(f), "default": f.default, "help": spec.help}
            if isinstance(f.default, bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = type(f.default)
                if spec.choices is not None:
                    kwargs["choices"] = spec.choices
                if spec.metavar is not None:
                    kwargs["metavar"] = spec.metavar
            group.add_argument(_flag(f), **kwargs)

    @classmethod
    def from_namespace(cls: type[Opts], args: argparse.Namespace) -> Opts:
        """The options from parsed flags (validated; a missing attribute keeps the default)."""
        values = {f.name: getattr(args, _dest(f)) for f in _option_fields(cls) if hasattr(args, _dest(f))}
        return cls(**values)

    def to_argv(self) -> list[str]:
        """The same settings as flags (what ``from_namespace`` reads back)."""
        return merged_argv([self])

    def check_machine(self, device: str) -> None:
        """``UsageError`` for a choice this machine (or ``--device``) cannot honour; nothing by default."""


def merged_argv(options: Iterable[StageOptions]) -> list[str]:
    """The flags of several stages' options, each flag once (a shared flag has one value)."""
    argv: list[str] = []
    seen: set[str] = set()
    for opts in options:
        for f in _option_fields(type(opts)):
            if _flag(f) in seen:
                continue
            seen.add(_flag(f))
            value = getattr(opts, f.name)
            argv += ([_flag(f) if value else "--no-" + _flag(f)[2:]] if isinstance(value, bool)
                     else [_flag(f), str(value)])
    return argv
