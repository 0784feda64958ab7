"""User-facing errors: ``train.py`` and the scripts print their one-line message and exit with its code
(2 for bad input, unless a subclass says otherwise)."""

import sys


def print_error(text: str) -> None:
    """``text`` and its newline to stderr in one write: under PYTHONUNBUFFERED (Slurm jobs, the sweep's trainers)
    ``print`` writes the two separately, and two ranks sharing the stream then glue their lines together."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class UserError(Exception):
    """Bad input from the user (config, data, tokenizer, checkpoint). The message names the problem and the fix."""

    exit_code = 2


class ConfigError(UserError):
    """A bad configuration; the message is one line meant for the user."""


class DataError(UserError):
    """A data source or tokenizer that cannot be used."""


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded into this run, or saved (disk full, read-only folder)."""


class RunFolderError(UserError):
    """A run folder that is in use by another run or cannot be written."""


class DivergedError(UserError):
    """Training stopped after too many consecutive non-finite steps (exit code 3: not bad input as such)."""

    exit_code = 3


class RunFailure(Exception):
    """A failure that is not the user's: a peer rank died or a save failed for a reason other than disk space or
    permissions (exit code 1, ``failure:`` line). The run resumes from its newest complete checkpoint."""

    exit_code = 1
