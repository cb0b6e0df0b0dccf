"""The errors a user can fix. Entry points print them as one line, without a traceback."""


class BatchsweepError(Exception):
    """An error the user can fix; entry points print it as one line, without a traceback."""


class ConfigError(BatchsweepError, ValueError):
    """A configuration value that is unknown, malformed or out of range."""


class DataError(BatchsweepError):
    """A dataset that cannot be found or made."""


class CheckpointError(BatchsweepError):
    """A checkpoint that cannot be read or written, or is of another run."""
