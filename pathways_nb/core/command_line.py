"""How every pathways-nb command line reads its flags: one spelling, with underscores.

Flags are declared as ``--hosts_per_island`` (the spelling of Pathways' containers and of most of
our flags). ``ArgumentParser`` also reads each one written with hyphens (``--hosts-per-island``),
and a flag's former name where one was renamed (``alias``), without showing either in ``--help``:
scripts written for an older spelling keep working, and every command lists one spelling. The
parsers of subcommands are made by the parser they belong to, so each command added later
(``add_subparsers().add_parser``) reads the hyphen spellings as well, with nothing to declare.
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
