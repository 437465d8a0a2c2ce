"""`--lengths FILE`: one non-negative integer per line, sample id = line number from 0."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from odbd.errors import ConfigError
from odbd.simulate.lengths import read_lengths, read_lengths_and_patches


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lengths.txt"
    path.write_text(text, encoding="utf-8")
    return path


def test_reads_one_length_per_line_in_order(tmp_path: Path) -> None:
    lengths = read_lengths(write(tmp_path, "5\n0\n 17 \n12288\n"))
    assert lengths.dtype == np.int64
    assert lengths.tolist() == [5, 0, 17, 12288]


def test_missing_final_newline_and_empty_file(tmp_path: Path) -> None:
    assert read_lengths(write(tmp_path, "3\n4")).tolist() == [3, 4]
    assert read_lengths(write(tmp_path, "")).shape == (0,)


@pytest.mark.parametrize(
    ("text", "line", "bad"),
    [
        ("1\n2\n-3\n", 3, "'-3'"),
        ("1\n2.5\n", 2, "'2.5'"),
        ("tokens\n1\n", 1, "'tokens'"),
        ("1\n\n2\n", 2, "''"),
        ("1\n+4\n", 2, "'+4'"),
        ("1\n1e3\n", 2, "'1e3'"),
    ],
)
def test_bad_line_names_file_line_and_text(tmp_path: Path, text: str, line: int, bad: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        read_lengths(path)
    message = str(info.value)
    assert f"{path}:{line}:" in message and bad in message


def test_too_large_for_int64(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=":2: .*64 bits"):
        read_lengths(write(tmp_path, "1\n99999999999999999999\n"))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_lengths(tmp_path / "nope.txt")


def test_a_second_column_carries_patch_counts(tmp_path: Path) -> None:
    lengths, patches = read_lengths_and_patches(write(tmp_path, "5 0\n7  12\n 9\t3 \n"))
    assert lengths.tolist() == [5, 7, 9] and patches is not None and patches.tolist() == [0, 12, 3]
    assert read_lengths_and_patches(write(tmp_path, "5\n7\n"))[1] is None


@pytest.mark.parametrize("text", ["5 1\n7\n", "5\n7 1\n", "5 1 2\n", "5 -1\n"])
def test_patch_columns_must_be_on_every_line_and_counts(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match=r":\d: expected one non-negative integer"):
        read_lengths_and_patches(write(tmp_path, text))
