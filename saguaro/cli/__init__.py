"""The command line, ``saguaro SUBCOMMAND``: one module per subcommand, each declaring itself (``COMMAND``)
and listed in :mod:`saguaro.cli.main`. May import any folder; nothing in the library imports the CLI."""

from saguaro.cli.main import main

__all__ = ["main"]
