"""Errors that name a bad setting or input and its fix: the entry points print them as one
line and exit with code 2 (utils/entry_point.refuse_bad_input)."""


class ConfigError(ValueError):
    """The config asks for something that cannot run; the message says what to use."""


class DataError(ValueError):
    """The data cannot be used as configured; the message says what to change."""
