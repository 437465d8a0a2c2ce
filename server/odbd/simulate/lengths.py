"""`--lengths FILE`: one non-negative integer token length per line; sample id = line number.
A line may carry a second column, the sample's vision patches (`LENGTH PATCHES`, whitespace
between), for --max-patches; then every line must."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from odbd.errors import ConfigError

_MAX_DIGITS = 18  # any 18-digit decimal fits in int64; longer ones may not


def read_lengths(path: str | Path) -> np.ndarray:
    """(N,) int64 lengths; row i is sample id i (line i + 1 of the file, counting from 1)."""
    return read_lengths_and_patches(path)[0]


def read_lengths_and_patches(path: str | Path) -> tuple[np.ndarray, np.ndarray | None]:
    """(N,) int64 lengths and, when the file has a second column, (N,) int64 patch counts.

    Zero is legal here: the planner refuses 0-length samples itself and counts them. Anything
    else that is not a plain non-negative decimal integer (floats, signs, blank lines, words), or
    a line with another number of columns than the first, is a ConfigError naming the file, the
    line number and the offending text.
    """
    text = _read_text(Path(path))
    rows = [line.split() for line in text.splitlines()]
    columns = len(rows[0]) if rows else 1
    for index, (line, row) in enumerate(zip(text.splitlines(), rows, strict=True)):
        if len(row) != columns or columns > 2 or not all(_is_count(x) for x in row):
            raise ConfigError(
                f"{path}:{index + 1}: expected one non-negative integer token length per line "
                f"(optionally a second column of patch counts, on every line), got {line!r}; "
                "nothing was simulated. Fix or remove that line"
            )
        if any(len(x) > _MAX_DIGITS for x in row):
            raise ConfigError(
                f"{path}:{index + 1}: {line.strip()} does not fit in 64 bits; nothing was "
                "simulated. Token lengths and patches are counts: fix that line"
            )
    table = np.array([[int(x) for x in row] for row in rows], dtype=np.int64).reshape(-1, columns)
    return table[:, 0].copy(), (table[:, 1].copy() if columns == 2 else None)


def _is_count(text: str) -> bool:
    # isascii() first: str.isdigit() also accepts characters like '²' that int() rejects.
    return text.isascii() and text.isdigit()


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
