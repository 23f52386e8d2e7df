"""The command line, ``saguaro SUBCOMMAND``: one module per subcommand, each registering itself in
:mod:`saguaro.cli.main`. May import any folder; nothing in the library imports the CLI."""

from saguaro.cli.main import main

__all__ = ["main"]
