"""Every `relex` command README.md shows parses with the real parser, and its command table matches the parser.

A command a new user copies from the README must not fail with "unrecognized arguments" or "the following
arguments are required": the commands of its code blocks are parsed as `relex` would parse them (nothing runs), and
each row of the command reference names only options the command has, with every required one outside brackets.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from relex.cli import COMMANDS, build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def code_block_commands(text: str) -> list[str]:
    """The `relex ...` commands of the bash and console code blocks (`\\` continuations joined, comments dropped).

    In a console block only the lines after a `$ ` prompt are commands; the rest is their output.
    """
    commands = []
    for language, block in re.findall(r"^```(bash|sh|shell|console)\n(.*?)^```", text, flags=re.S | re.M):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            if language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            line = line.split(" #")[0].strip()
            if line.startswith("relex "):
                commands.append(line)
    return commands


def table_rows(text: str) -> list[str]:
    """The synopses of the command reference table: `relex CMD ...` in the first cell of each row."""
    rows = re.findall(r"^\| `(relex [^`]*)` \|", text, flags=re.M)
    return [row.replace("\\|", "|") for row in rows]


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser(only=command)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[command]


def option_strings(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    """All option strings of `parser`, and those of its required options."""
    every = {s for a in parser._actions for s in a.option_strings}
    required = {max(a.option_strings, key=len) for a in parser._actions if a.option_strings and a.required}
    return every, required


def test_readme_shows_commands():
    text = README.read_text()
    assert len(code_block_commands(text)) >= 8
    assert {row.split()[1] for row in table_rows(text)} == set(COMMANDS), "every command has a row in the table"


@pytest.mark.parametrize("command", code_block_commands(README.read_text()))
def test_code_block_command_parses(command, capsys):
    argv = shlex.split(command)[1:]
    assert argv[0] in COMMANDS, f"README shows an unknown command: {command}"
    try:
        build_parser(only=argv[0]).parse_args(argv)
    except SystemExit:
        pytest.fail(f"README command does not parse: {command}\n{capsys.readouterr().err}")


@pytest.mark.parametrize("row", table_rows(README.read_text()))
def test_command_table_row_matches_the_parser(row):
    words = row.split()
    command = words[1]
    assert command in COMMANDS, f"README table names an unknown command: {row}"
    parser = subparser(command)
    if command == "plot":  # `relex plot FIGURE ...`: the figures are subcommands of their own
        (figures,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        assert words[2].split("|") == list(figures.choices), row
        common = set.intersection(*(option_strings(figure)[1] for figure in figures.choices.values()))
        assert common <= set(re.findall(r"--[\w-]+", row)), f"{row}: required by every figure: {sorted(common)}"
        return
    every, required = option_strings(parser)
    shown = set(re.findall(r"--[\w-]+", row))
    outside_brackets = set(re.findall(r"--[\w-]+", re.sub(r"\[[^\]]*\]", "", row)))
    assert shown <= every, f"{row}: options the parser does not have: {sorted(shown - every)}"
    assert required <= outside_brackets, f"{row}: required options missing or shown as optional: {sorted(required - outside_brackets)}"
