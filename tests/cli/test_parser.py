"""`kiln`'s parser (pipeline/cli/parser.py) and its command modules: each command is one module with NAME, HELP,
`arguments` and `run`, listed once; every stage is a subcommand; `--help` of each parses. What each `run` does is
exercised through `cli.main([...])` by the feature tests (release, registry, reliability, systems)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from pipeline.cli import parser
from pipeline.dagtools import catalog


def test_every_command_module_has_one_name_help_arguments_and_run():
    names = [c.NAME for c in parser.COMMANDS]
    assert len(names) == len(set(names)) and len(names) >= 20, names
    stages = {d.name for d in catalog.declared()}
    assert not (set(names) & (stages | set(parser.FORWARDED))), "a command shadows a stage or a forwarded CLI"
    for c in parser.COMMANDS:
        assert c.HELP.strip() and callable(c.arguments) and callable(c.run), c.__name__
        assert c.__name__ == f"pipeline.cli.{c.NAME.replace('-', '_')}", (c.__name__, c.NAME)
    files = {p.stem for p in (REPO / "pipeline" / "cli").glob("*.py")} - {"__init__", "__main__", "parser", "common"}
    assert files == {c.__name__.rpartition(".")[2] for c in parser.COMMANDS}, "a command module not in COMMANDS"


@pytest.mark.parametrize("command", [c.NAME for c in parser.COMMANDS])
def test_each_commands_help_parses(command, capsys):
    with pytest.raises(SystemExit) as e:
        parser.build_parser().parse_args([command, "--help"])
    assert e.value.code == 0 and command in capsys.readouterr().out


def test_the_parser_lists_stages_forwarded_clis_and_commands(capsys):
    with pytest.raises(SystemExit):
        parser.build_parser().parse_args(["--help"])
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("    ") and
              not line.startswith("     ")}
    assert {"export", "compile", "dag", "deps", *(c.NAME for c in parser.COMMANDS)} <= listed, listed


def test_python_m_pipeline_cli_is_kiln():
    r = subprocess.run([sys.executable, "-m", "pipeline.cli", "targets", "--help"], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "usage: kiln targets" in r.stdout, r.stderr
