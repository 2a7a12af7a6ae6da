"""Errors every floor may raise and every front end reports: the bottom of the import graph.

``UsageError`` is something the user can fix in what they typed (the CLI prints
"error: <message>" and exits 2; the window shows it); ``ConfigError`` is a config
file that cannot be used (the message names the file and field).  They live here,
not with the CLI or the loaders, so that a lower floor (the remote frontend, the
audio features) can raise them without importing a higher one.
"""


class UsageError(Exception):
    """Something the user can fix; main prints "error: <message>" and exits 2."""


class ConfigError(ValueError):
    """A config file is not usable; the message names the file and field."""


__all__ = ["ConfigError", "UsageError"]
