"""Errors that name a bad setting or input and its fix: the entry points print them as one
line and exit with code 2 (utils/entry_point.refuse_bad_input)."""

import errno
import shutil
from numbers import Integral, Real
from pathlib import Path


class ConfigError(ValueError):
    """The config asks for something that cannot run; the message says what to use."""


class DataError(ValueError):
    """The data cannot be used as configured; the message says what to change."""


class OutputError(RuntimeError):
    """The run's files cannot be written where the config puts them (a full disk, a folder
    made read-only mid-run); the message names the file."""


def is_number(value: object) -> bool:
    """A real number (not a bool, nor a string: Hydra reads `abc` and `1e-3x` as strings)."""
    return isinstance(value, Real) and not isinstance(value, bool)


def require_positive(prefix: str, **settings: float | None) -> None:
    """Refuse the first of `settings` (named `<prefix>.<name>`) that is set and not a number
    above 0, where it would otherwise fail deep inside torch (a division by zero, a string
    compared) or run silently."""
    for name, value in settings.items():
        if value is not None and not (is_number(value) and value > 0):
            raise ConfigError(f"{prefix}.{name}={value} must be a number above 0")


def is_whole(value: object) -> bool:
    """A whole number (not a bool, which Python counts as one)."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def is_count(value: object) -> bool:
    """A whole number above 0."""
    return is_whole(value) and value >= 1


def require_counts(prefix: str, **settings: int | None) -> None:
    """require_positive of whole numbers: a count of 1.5 (data.rows=1.5) failed mid-setup
    with a TypeError from deep inside."""
    for name, value in settings.items():
        if value is not None and not is_count(value):
            raise ConfigError(f"{prefix}.{name}={value} must be a whole number above 0")


def require_flags(prefix: str, **settings: bool) -> None:
    """Refuse the first of `settings` that is not true or false: Hydra reads `no` and `off`
    as strings, which Python takes as true (model.compile=off compiled)."""
    for name, value in settings.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{prefix}.{name}={value} must be true or false")


def space_advice(error: BaseException) -> str:
    """ "free space there, or " where `error` is a full disk (or a quota; torch's writer raises
    a RuntimeError without an errno there), else nothing: no space to free for a read-only one."""
    full = getattr(error, "errno", errno.ENOSPC) in (errno.ENOSPC, errno.EDQUOT, None)
    return "free space there, or " if full else ""


def free_space(path: Path) -> str:
    """The space left on `path`'s file system, for a message."""
    try:
        return f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free there"
    except OSError:
        return "the space left there unknown"
