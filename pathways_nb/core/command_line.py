"""How every pathways-nb command line reads its flags: one spelling, with underscores.

Flags are declared as ``--hosts_per_island`` (the spelling of Pathways' containers and of most of
our flags). ``ArgumentParser`` also reads each one written with hyphens (``--hosts-per-island``),
and a flag's former name where one was renamed (``alias``), without showing either in ``--help``:
scripts written for an older spelling keep working, and every command lists one spelling. The
parsers of subcommands are made by the parser they belong to, so each command added later
(``add_subparsers().add_parser``) reads the hyphen spellings as well, with nothing to declare.

Each command's module declares its own flags (``add_parser``); the flags that several commands
share are declared here once, with one help text.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


class ArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that reads ``--a-b`` as its flag ``--a_b``, and former names as aliases."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.former_names: dict[str, str] = {}  # a renamed flag's old name -> its name

    def alias(self, former: str, flag: str) -> None:
        """Reads ``former`` (a flag's old name, hidden from ``--help``) as ``flag``, a flag of this parser."""
        if flag not in self._option_string_actions:
            raise ValueError(f"{flag} is not a flag of {self.prog}: declare it before its alias {former}")
        self.former_names[former] = flag

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        words = list(sys.argv[1:] if args is None else args)
        if "--" in words:  # after a bare "--", words are values, however they look
            end = words.index("--")
            words = [*map(self._declared_spelling, words[:end]), *words[end:]]
        else:
            words = [self._declared_spelling(word) for word in words]
        return super().parse_known_args(words, namespace)

    def _declared_spelling(self, word: str) -> str:
        """``word`` with its flag spelled as declared, if it is another spelling of one of this parser's flags.

        Each parser reads only its own flags' spellings; the words it hands on to a subcommand are
        read again by the subcommand's parser. A hyphenated word that names no flag of this parser
        (not even an abbreviation of one) is left as typed, so an error quotes it as the user wrote it.
        """
        if not word.startswith("--") or word == "--":
            return word
        name, equals, value = word.partition("=")
        if name in self._option_string_actions:
            return word
        underscored = "--" + name[2:].replace("-", "_")
        if underscored in self.former_names:
            return self.former_names[underscored] + equals + value
        if underscored != name and any(
            flag == underscored or (self.allow_abbrev and flag.startswith(underscored))
            for flag in self._option_string_actions
        ):
            return underscored + equals + value
        return word


DEVICES_HELP = "number of CPU devices to create (default: JAX's, 1); accelerators always serve all of theirs"


def byte_count(text: str) -> int:
    """A number of bytes, 0 or more (argparse's error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes (an integer, 0 or more)")
    return value


def add_port_file(parser: argparse.ArgumentParser) -> None:
    """``--port_file``, for a server a launcher starts (``launch.processes.ChildServer``)."""
    parser.add_argument("--port_file", default=None, help="write the bound port to this file once serving")


def add_suspend_memory_budget(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--suspend_memory_budget",
        type=byte_count,
        default=None,
        metavar="BYTES",
        help="bytes of suspended sessions' arrays a host keeps in its memory; beyond them they go to files under "
        "the storage root until the session resumes (default: no limit)",
    )


def add_storage_root(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--storage_root",
        default=None,
        help=f"directory {what} under; a client's gs://BUCKET/PATH is BUCKET/PATH there, and nothing is "
        "written outside it (default: $TMPDIR/pathways-nb-$USER/storage)",
    )
