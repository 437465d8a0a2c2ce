"""The config fingerprint: canonical setting values every daemon of a job must share (pure)."""

from __future__ import annotations

import enum
from collections.abc import Mapping

_NOT_SET = "(not set)"


def canonical_value(value: object) -> str:
    """One spelling per value, so equal settings compare equal however they were typed.

    Enums use their value, bools are "true"/"false", floats use repr (round-trips exactly), and
    integral floats collapse to ints so `--token-budget 12288` and `12288.0` agree.
    """
    if isinstance(value, enum.Enum):
        return canonical_value(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, float):
        return repr(value)
    return str(value)


def fingerprint_of(settings: Mapping[str, object]) -> dict[str, str]:
    """setting name -> canonical value, ready for RoundConfig.fingerprint."""
    return {str(name): canonical_value(value) for name, value in settings.items()}


def _show(value: str | None) -> str:
    if value is None:
        return _NOT_SET
    return value if value else '""'


def fingerprint_mismatch(
    ours: Mapping[str, str],
    theirs: Mapping[str, str],
    *,
    ours_name: str = "this daemon",
    theirs_name: str = "the peer",
) -> str | None:
    """The first differing setting (in name order) as an operator message, or None if all match.

    A setting present on one side only is a mismatch too: a daemon of another release that knows
    a setting this one does not must not be silently admitted.
    """
    for name in sorted(ours.keys() | theirs.keys()):
        mine, other = ours.get(name), theirs.get(name)
        if mine != other:
            return (
                f"setting {name} differs: {ours_name} has {_show(mine)}, {theirs_name} has "
                f"{_show(other)}; start every daemon with the same flags"
            )
    return None
