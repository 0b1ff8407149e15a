"""Errors that name a bad setting or input and its fix: the entry points print them as one
line and exit with code 2 (utils/entry_point.refuse_bad_input)."""


class ConfigError(ValueError):
    """The config asks for something that cannot run; the message says what to use."""


class DataError(ValueError):
    """The data cannot be used as configured; the message says what to change."""


def require_positive(prefix: str, **settings: float | None) -> None:
    """Refuse the first of `settings` (named `<prefix>.<name>`) that is set and not above 0,
    where it would otherwise fail deep inside torch (a division by zero) or run silently."""
    for name, value in settings.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{prefix}.{name}={value} must be above 0")
