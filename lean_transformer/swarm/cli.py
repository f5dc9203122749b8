"""One way to report a bad command line, shared by every command of the project (the peers' flags, the demo, the
auth tool): a single ``prog: error: message`` line and exit status 2, instead of argparse's usage block (which
``--help`` still shows in full)."""
from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineErrors:
    """Mixed in front of an ``argparse.ArgumentParser`` (or a subclass such as ``HfArgumentParser``)."""

    prog: str

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class OneLineErrorParser(OneLineErrors, argparse.ArgumentParser):
    """A plain ``argparse.ArgumentParser`` with one-line errors."""
