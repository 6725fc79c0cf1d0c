"""The CLI's shape: one module per command (its subparser and its run), a short main.py."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import shardio.cli
from shardio.cli.main import COMMANDS, build_parser

CLI_DIR = Path(shardio.cli.__file__).parent


def _listed_commands() -> list[str]:
    """The commands `shardio --help` lists, read from the parser itself."""
    parser = build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subs) == 1
    return list(subs[0].choices)


def test_every_command_has_its_own_module_with_its_help_arguments_and_run() -> None:
    listed = _listed_commands()
    assert listed == list(COMMANDS)  # the registry is what --help lists, in its order
    for name in listed:
        assert (CLI_DIR / f"{name}.py").is_file(), f"no shardio/cli/{name}.py for {name!r}"
        module = importlib.import_module(f"shardio.cli.{name}")
        assert COMMANDS[name] is module, f"{name!r} is not run by shardio.cli.{name}"
        assert isinstance(getattr(module, "HELP", None), str), f"{name}: no HELP line"
        assert callable(getattr(module, "add_arguments", None)), f"{name}: no add_arguments"
        assert callable(getattr(module, "run", None)), f"{name}: no run"


def test_each_module_adds_only_arguments_to_its_own_parser() -> None:
    for name, module in COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"shardio {name}")
        module.add_arguments(parser)
        assert parser.prog == f"shardio {name}"


def test_main_stays_short() -> None:
    lines = (CLI_DIR / "main.py").read_text(encoding="utf-8").count("\n")
    assert lines < 200, f"shardio/cli/main.py has {lines} lines: a command belongs in its module"
