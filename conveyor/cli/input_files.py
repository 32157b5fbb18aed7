"""What the CLI reads from a file or stdin, as text: bounded, so that `--body @/dev/zero` or
a platform file on a pipe that never ends is a one-line error, not a MemoryError after every
byte of memory is taken (a sweep). The bound is above anything a command has use for: the
gateway takes a batch of 16 MiB at most."""

from __future__ import annotations

import sys
from pathlib import Path

MAX_INPUT_CHARACTERS = 32 * 2**20


class InputTooLarge(OSError):
    """More than MAX_INPUT_CHARACTERS: an OSError, as a file that cannot be read is."""


def read_text(source: str | Path, limit: int = MAX_INPUT_CHARACTERS) -> str:
    """`source` ('-': stdin, in its own encoding) as text; a file is read as UTF-8."""
    if str(source) == "-":
        text = sys.stdin.read(limit + 1)
    else:
        with Path(source).open(encoding="utf-8") as file:
            text = file.read(limit + 1)
    if len(text) > limit:
        raise InputTooLarge(f"{source}: more than {limit} characters")
    return text
