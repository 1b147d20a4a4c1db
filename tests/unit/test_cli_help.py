"""Every argument of every `megatron-rl` command says what it does, not only its default.

The commands are the ones `megatron-rl --help` lists. Each command's parser is taken from its
own entry point, called with argparse's parsing stopped: the parser is built exactly as the
command builds it, and nothing of the command runs.
"""
import argparse
import re
import subprocess
import sys

import pytest

from megatron_rl import cli

# A statement of the default: "(default: 32)", "default: %(default)s", "(default: unset, ...)".
DEFAULT_CLAUSE = re.compile(r"\(?\bdefault: [^()]*\)?")


class _ParserBuilt(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def command_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `megatron-rl <name>` builds; its parse (parse_args, parse_known_args and the
    intermixed forms all go through parse_known_args) raises before any of the command runs."""
    def stop(self, args=None, namespace=None):
        raise _ParserBuilt(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop)
    with pytest.raises(_ParserBuilt) as built:
        cli.commands()[name].load()([])
    return built.value.parser


def description_words(help_text: str | None) -> list[str]:
    """The words of a help string that are not its default."""
    text = (help_text or "").replace("%(default)s", "")
    return DEFAULT_CLAUSE.sub(" ", text).split()


def test_help_lists_every_registered_command():
    out = subprocess.run([sys.executable, "-m", "megatron_rl.cli", "--help"], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    listed = re.findall(r"^  (\S+)", out.split("\ncommands:\n", 1)[1], flags=re.M)
    assert listed == list(cli.commands()), out
    assert {"train", "eval", "convert", "toy"} <= set(listed)


def test_a_help_that_only_gives_its_default_is_caught():
    for bare in (None, "", "default: 3", "(default: %(default)s)", "(default: unset)",
                 "the k (default: 32)"):
        assert len(description_words(bare)) < 3, bare
    assert description_words("sampling seeds, one pass each (default: %(default)s)") == [
        "sampling", "seeds,", "one", "pass", "each"]


@pytest.mark.parametrize("name", list(cli.commands()))
def test_every_argument_says_what_it_does(name, monkeypatch):
    parser = command_parser(name, monkeypatch)
    arguments = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert arguments, f"megatron-rl {name}: no arguments found"
    for action in arguments:
        flag = "/".join(action.option_strings) or action.dest
        assert action.help is not argparse.SUPPRESS, f"megatron-rl {name} {flag}: hidden"
        assert len(description_words(action.help)) >= 3, (
            f"megatron-rl {name} {flag}: help says no more than its default ({action.help!r})")
    parser.format_help()  # every help string survives argparse's %-formatting
