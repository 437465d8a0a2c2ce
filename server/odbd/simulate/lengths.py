"""`--lengths FILE`: one non-negative integer token length per line; sample id = line number."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from odbd.errors import ConfigError

_MAX_DIGITS = 18  # any 18-digit decimal fits in int64; longer ones may not


def read_lengths(path: str | Path) -> np.ndarray:
    """(N,) int64 lengths; row i is sample id i (line i + 1 of the file, counting from 1).

    Zero is legal here: the planner refuses 0-length samples itself and counts them. Anything
    else that is not a plain non-negative decimal integer (floats, signs, blank lines, words) is a
    ConfigError naming the file, the line number and the offending text.
    """
    text = _read_text(Path(path))
    lines = text.splitlines()
    for index, line in enumerate(lines):
        stripped = line.strip()
        # isascii() first: str.isdigit() also accepts characters like '²' that int() rejects.
        if not (stripped.isascii() and stripped.isdigit()):
            raise ConfigError(
                f"{path}:{index + 1}: expected one non-negative integer token length per line, "
                f"got {line!r}; nothing was simulated. Fix or remove that line"
            )
        if len(stripped) > _MAX_DIGITS:
            raise ConfigError(
                f"{path}:{index + 1}: length {stripped} does not fit in 64 bits; nothing was "
                "simulated. Token lengths are counts of tokens: fix that line"
            )
    return np.array([int(line) for line in lines], dtype=np.int64)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"lengths file {path} does not exist; nothing was simulated. Pass --lengths with a "
            "file holding one token length per line"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"cannot read lengths file {path}: {error}; nothing was simulated. Pass --lengths "
            "with a readable UTF-8 text file holding one token length per line"
        ) from None
