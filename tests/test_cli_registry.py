"""The CLI's subcommand registry: the parser offers exactly the registered subcommands, each declared by a
module of its own named after it, and ``main`` dispatches to them (no model is loaded here)."""

import argparse
import ast
import importlib
from pathlib import Path

import pytest

from saguaro.cli.registry import Subcommand, load

cli_main = importlib.import_module(
    "saguaro.cli.main"
)  # the module: ``saguaro.cli.main`` is also the function

CLI = Path(cli_main.__file__).parent


def parser_subcommands(parser: argparse.ArgumentParser) -> list[str]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return list(action.choices)


def module_stem(name: str) -> set[str]:
    """The module names a subcommand may live in: ``draft-server`` → draft_server (or draft_server_cmd,
    for a name that would shadow the standard library when run as a script, like ``inspect``)."""
    stem = name.replace("-", "_")
    return {stem, f"{stem}_cmd"}


def test_the_parser_offers_exactly_the_registered_subcommands_in_order():
    commands = cli_main.subcommands()
    assert parser_subcommands(cli_main.build_parser()) == list(commands)
    assert list(commands) == ["generate", "bench", "export", "inspect", "report", "draft-server", "serve"]


def test_each_subcommand_lives_in_a_module_of_its_own_named_after_it():
    commands = cli_main.subcommands()
    modules = [c.module for c in commands.values()]
    assert len(set(modules)) == len(modules), modules
    for name, command in commands.items():
        package, _, stem = command.module.rpartition(".")
        assert package == "saguaro.cli" and stem in module_stem(name), (name, command.module)
        assert (CLI / f"{stem}.py").is_file()
        assert command.add_arguments.__module__ == command.module, (name, command.add_arguments)


def test_every_module_that_declares_a_subcommand_is_listed():
    """A new ``saguaro/cli/x.py`` with ``COMMAND = Subcommand(...)`` that main does not list would never run."""
    declaring = set()
    for path in CLI.glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "COMMAND" for t in node.targets
            ):
                declaring.add(path.stem)
    assert declaring == set(cli_main.SUBCOMMAND_MODULES)


def test_load_names_a_module_without_a_subcommand_or_a_name_declared_twice():
    with pytest.raises(TypeError, match=r"saguaro\.cli\.args has no COMMAND"):
        load("saguaro.cli", ("generate", "args"))
    with pytest.raises(ValueError, match=r"'generate' is declared by both"):
        load("saguaro.cli", ("generate", "generate"))


def test_main_dispatches_to_the_registered_run_and_turns_value_errors_into_status_2(monkeypatch, capsys):
    def add_arguments(parser):
        parser.add_argument("--fail", action="store_true")

    def run(args):
        if args.fail:
            raise ValueError("--fail given: nothing to do")
        return 7

    fake = {"fake": Subcommand("fake", "a stand-in", add_arguments, run)}
    monkeypatch.setattr(cli_main, "subcommands", lambda: fake)
    assert cli_main.main(["fake"]) == 7
    assert cli_main.main(["fake", "--fail"]) == 2
    assert capsys.readouterr().err == "saguaro: error: --fail given: nothing to do\n"


def test_bench_generate_and_serve_take_the_weight_options():
    from saguaro.cli.args import weight_options

    parser = cli_main.build_parser()
    for command in (["bench"], ["generate", "--prompt", "x"], ["serve"]):
        args = parser.parse_args(
            [*command, "--weights", "int4", "--draft-weights", "as-loaded", "--weight-group-size", "32"]
        )
        assert weight_options(args) == {
            "weights": "int4",
            "draft_weights": "as-loaded",
            "weight_group_size": 32,
        }
        assert weight_options(parser.parse_args(command)) == {
            "weights": "as-loaded",
            "draft_weights": None,
            "weight_group_size": None,
        }
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--weights", "int3"])
