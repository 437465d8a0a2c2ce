"""How every odbd command reads its flags: checked at parse time, one line per error.

`OneLineParser` is the parser of `odbd`, `odbd status`, `odbd demo` and `odbd simulate`:
errors are one line and exit status 2 (never a usage dump or a traceback), an unknown flag is
named with the closest known one (prefix abbreviations are off, so `--work` is not silently
`--workers`), and `--help` shows every default.

The `type=` functions below check a value's syntax *and* range, so a bad value is refused
before anything starts whether it came from the command line or from ODBD_<FLAG> (the daemon
feeds environment values through the same functions, see `odbd.cli.apply_environment`).
Their messages say what is expected and what was given; argparse prefixes the flag's name.
"""

from __future__ import annotations

import argparse
import difflib
import math
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

EXIT_USAGE = 2
# sockaddr_un.sun_path is 108 bytes on Linux, including the terminating NUL; beside the gRPC
# socket lie the trainers' step socket (path + ".steps") and the producers' ingest socket
# (path + ".ingest", odbclient.framing), so --socket gets the longer suffix's 7 bytes less.
MAX_SOCKET_PATH_BYTES = 107 - len(".ingest")
# The daemon and the simulator hold a few int64 arrays of N entries (sampler order, ledger,
# lengths): past 2^32 samples that is tens of GiB, so a bigger N is a typo, not a dataset.
MAX_DATASET_SIZE = 1 << 32
MAX_SEED = 2**63 - 1  # torch generators take seed + epoch up to 2^64 - 1
BOOLEAN_WORDS = {"1": True, "true": True, "yes": True, "on": True}
BOOLEAN_WORDS |= {"0": False, "false": False, "no": False, "off": False}
# A token argparse reads as a (negative) number, not as an option: "-1", "-0.5", "-1e3".
_NUMBER = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
# A value that starts like a negative number but is no number to argparse ("-16M", "-1.5G"):
# after a flag that takes a value it is that value, so its type check can say what is wrong
# (it was "unrecognized argument -16M", which named no flag).
_NEGATIVE_LOOKING = re.compile(r"-\.?\d")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows `(default: X)` after every help text and keeps the description's line breaks.

    An unset default (None, empty, a switch's False) is left out: the help text says what "not
    given" means.
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        unset = action.default is None or action.default in ("", (), [])
        if unset or isinstance(action, argparse._StoreTrueAction):  # off unless given
            return action.help
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, exit 2, and name the likely typo."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        argv = self._join_negative_values(list(sys.argv[1:] if args is None else args))
        # argparse checks required flags before unknown ones, so `--wrold 2` would otherwise
        # be reported as a missing --world.
        unknown = first_unknown_option(argv, list(self._option_string_actions))
        if unknown is not None:
            self.error(f"unrecognized argument {unknown}{did_you_mean(unknown, self.options)}")
        return super().parse_args(argv, namespace)

    def _join_negative_values(self, argv: list[str]) -> list[str]:
        """`--shm-size -16M` as `--shm-size=-16M`: argparse would read -16M as an option."""
        out: list[str] = []
        i = 0
        while i < len(argv):
            token = argv[i]
            action = self._option_string_actions.get(token)
            takes_value = action is not None and action.nargs is None
            if takes_value and i + 1 < len(argv) and _NEGATIVE_LOOKING.match(argv[i + 1]):
                out.append(f"{token}={argv[i + 1]}")
                i += 2
                continue
            if token == "--":
                return out + argv[i:]
            out.append(token)
            i += 1
        return out

    @property
    def options(self) -> list[str]:
        return [o for o in self._option_string_actions if o.startswith("--")]


def first_unknown_option(argv: Sequence[str], known: Sequence[str]) -> str | None:
    """The first token that argparse would read as an option but no flag matches exactly."""
    for token in argv:
        if token == "--":
            return None
        if not token.startswith("-") or token == "-" or _NUMBER.fullmatch(token):
            continue
        name = token.split("=", 1)[0]
        if name not in known:
            return name
    return None


def closest(word: str, candidates: Sequence[str]) -> str | None:
    """The candidate `word` is most likely a typo of, if any is close."""
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: str, candidates: Sequence[str], quote: str = "") -> str:
    """`; did you mean X?` for the closest candidate, or "" when none is close."""
    match = closest(word, candidates)
    return f"; did you mean {quote}{match}{quote}?" if match else ""


# -- value types: each returns the parsed value or raises ArgumentTypeError --------------------


def _typed(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    parse.__name__ = name  # argparse names the type in some messages
    return parse


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer in [minimum, maximum]."""
    bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"

    def parse(text: str) -> int:
        value = whole_number(text, bound)
        if value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected an integer {bound}, got {text!r}")
        return value

    return _typed("integer", parse)


def whole_number(text: str, bound: str = "") -> int:
    """An integer, also written as a float that is one ("1e4", "12288.0"): environment files
    and launchers write numbers that way, and Python's `invalid literal for int()` named neither
    the value's flag nor what to write."""
    want = f"an integer{' ' + bound if bound else ''}"
    try:
        return int(text.strip())
    except ValueError:
        pass
    try:
        value = float(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
    if not math.isfinite(value) or not value.is_integer():
        raise argparse.ArgumentTypeError(
            f"expected {want}, got {text!r}, which is not a whole number"
        )
    return int(value)


def any_integer(text: str) -> int:
    """An integer of any sign (its range is checked by the config that takes it)."""
    return whole_number(text)


any_integer.__name__ = "integer"


def seconds(*, allow_zero: bool) -> Callable[[str], float]:
    """A finite number of seconds, > 0 (or >= 0 with allow_zero)."""
    bound = ">= 0" if allow_zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"expected seconds {bound}, got {text!r}")
        return value

    return _typed("seconds", parse)


def number(text: str) -> float:
    """Any finite number."""
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in 0..1."""
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a fraction in 0..1 (e.g. 0.01), got {text!r}")
    return value


def size_bytes(text: str) -> int:
    """Bytes with an optional K/M/G/T suffix (powers of two): 512M, 4G, 1.5G, 1048576."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    body = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = units.get(body[-1:], 1)
    if scale != 1:
        body = body[:-1]
    try:
        value = float(body)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a size like 512M or 4G, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be positive: expected a size like 512M or 4G, got {text!r}"
        )
    return int(value * scale)


def host_port(text: str) -> str:
    """HOST:PORT with a port in 0..65535 (IPv6 as [::1]:PORT)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 127.0.0.1:7070), got {text!r}")
    return text.strip()


def optional_host_port(text: str) -> str:
    """HOST:PORT, or empty for "off"."""
    return host_port(text) if text.strip() else ""


def key_list(text: str) -> tuple[str, ...]:
    """KEY or KEY,KEY,...: sample keys (so one ODBD_ variable can name several)."""
    keys = tuple(key.strip() for key in text.split(","))
    if not keys or not all(keys):
        raise argparse.ArgumentTypeError(
            f"expected KEY or KEY,KEY,... with no empty key, got {text!r}"
        )
    return keys


def host_port_list(text: str) -> tuple[str, ...]:
    """Comma-separated HOST:PORT entries (empty = none)."""
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    for entry in entries:
        try:
            host_port(entry)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"entry {entry!r} is not HOST:PORT; list every daemon's peer address as "
                "HOST:PORT,HOST:PORT,... in node-rank order"
            ) from None
    return tuple(entries)


def nonempty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text.strip()


def key_value(text: str) -> tuple[str, str]:
    """KEY=VALUE with a non-empty key."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def key_number(text: str) -> tuple[str, float]:
    """KEY=NUMBER, e.g. input_ids=0."""
    key, value = key_value(text)
    try:
        return key, number(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected KEY=NUMBER (e.g. input_ids=0), got {text!r}"
        ) from None


def boolean(text: str) -> bool:
    """true/false, 1/0, yes/no, on/off (any case); anything else is refused, not read as false."""
    value = BOOLEAN_WORDS.get(text.strip().lower())
    if value is None:
        raise argparse.ArgumentTypeError(
            f"expected true or false (or 1/0, yes/no, on/off), got {text!r}"
        )
    return value


def socket_path(text: str) -> str:
    """A unix socket path within the AF_UNIX limit (checked here: bind would fail later)."""
    path = text.strip()
    if not path:
        raise argparse.ArgumentTypeError("expected a unix socket path, got ''")
    length = len(path.encode())
    if length > MAX_SOCKET_PATH_BYTES:
        raise argparse.ArgumentTypeError(
            f"{path!r} is {length} bytes, over the {MAX_SOCKET_PATH_BYTES}-byte limit of unix "
            "socket paths (107 bytes, less the '.ingest' of the producers' socket beside it); "
            "choose a shorter path"
        )
    return path


def choice_of(names: Sequence[str], *, upper: bool = False) -> Callable[[str], str]:
    """One of `names` (case-folded to upper with upper=True), suggesting the closest on a typo."""

    def parse(text: str) -> str:
        value = text.strip().upper() if upper else text.strip()
        if value not in names:
            raise argparse.ArgumentTypeError(
                f"expected one of {', '.join(names)}, got {text!r}{did_you_mean(value, names)}"
            )
        return value

    return _typed("choice", parse)
