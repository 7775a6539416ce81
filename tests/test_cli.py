"""The `kvshare` command line: every subcommand's --help prints (argparse formats each help text
with %-formatting, so a bare "%" in a setting's help made `kvshare serve --help` a traceback)."""

import argparse

import pytest

from services.cli import build_parser


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_subcommands_help_prints(name):
    text = subcommands()[name].format_help()
    assert text.startswith("usage: kvshare " + name)
