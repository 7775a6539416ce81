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


@pytest.mark.parametrize(("given", "field", "read"), [
    ([], "cache_required", None), (["--cache-required"], "cache_required", True),
    (["--cache-required", "false"], "cache_required", False), (["--cache-required", "--port", "7"], "cache_required", True),
    (["--reflection", "no"], "reflection", False), (["--reflection"], "reflection", True)])
def test_a_yes_no_setting_given_bare_means_yes(given, field, read):
    """`--cache-required` alone is true; a value still says which (`--reflection false`); unset
    (None) falls through to the environment and the default."""
    assert getattr(build_parser().parse_args(["serve", *given]), field) is read
