"""The subcommand registry: each subcommand's module declares ``COMMAND = Subcommand(...)``, and
:func:`load` gathers them from the modules :mod:`saguaro.cli.main` lists, checking one per module."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Subcommand:
    """``saguaro NAME``: ``add_arguments`` fills its parser; ``run`` does the work, returning the status."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]

    @property
    def module(self) -> str:
        """The module that defines it (its ``run``)."""
        return self.run.__module__


def load(package: str, modules: tuple[str, ...]) -> dict[str, Subcommand]:
    """``{name: Subcommand}`` from ``package.module.COMMAND`` for each of ``modules``, in their order."""
    commands: dict[str, Subcommand] = {}
    for name in modules:
        module = importlib.import_module(f"{package}.{name}")
        command = getattr(module, "COMMAND", None)
        if not isinstance(command, Subcommand):
            raise TypeError(
                f"{module.__name__} has no COMMAND: a subcommand module defines "
                f"COMMAND = Subcommand(...), got {command!r}"
            )
        if command.module != module.__name__:
            raise ValueError(
                f"{module.__name__}.COMMAND ({command.name!r}) runs {command.module}.run: "
                "a subcommand lives in the module that declares it"
            )
        if command.name in commands:
            raise ValueError(
                f"subcommand {command.name!r} is declared by both {commands[command.name].module} "
                f"and {module.__name__}: each name belongs to one module"
            )
        commands[command.name] = command
    return commands
