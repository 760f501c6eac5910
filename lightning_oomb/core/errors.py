"""The error for a configuration that cannot train, found before any long work."""


class SetupError(ValueError):
    """A configuration that cannot train, found before the first step: the message names the option or file and
    the way out. The command line prints it as one line (``lightning-oomb: error: ...``, exit status 2)."""
