"""Errors for operators and users: each message says what happened, what follows, and the fix."""


class OdbdError(Exception):
    """Base class of every odbd error."""


class ConfigError(OdbdError, ValueError):
    """Operator input (flags, environment, files) is invalid; nothing has started."""


class InvariantError(OdbdError, AssertionError):
    """An internal protocol invariant broke: a bug in odbd, never an input problem."""
