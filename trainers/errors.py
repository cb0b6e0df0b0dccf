"""The errors a user can fix. Entry points print them as one line, without a traceback."""


class BatchsweepError(Exception):
    """An error the user can fix; entry points print it as one line, without a traceback."""


class ConfigError(BatchsweepError, ValueError):
    """A configuration value that is unknown, malformed or out of range.

    `hint` is what to change on the command line; a sweep, whose points come from a study, says `problem` alone."""

    def __init__(self, problem: str, hint: str = ""):
        super().__init__(f"{problem}: {hint}" if hint else problem)
        self.problem = problem


class DataError(BatchsweepError):
    """A dataset that cannot be found or made."""


class CheckpointError(BatchsweepError):
    """A checkpoint that cannot be read or written, or is of another run."""
