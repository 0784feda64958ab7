"""User-facing errors: ``train.py`` and the scripts print their one-line message and exit with code 2."""


class UserError(Exception):
    """Bad input from the user (config, data, tokenizer, checkpoint). The message names the problem and the fix."""


class DataError(UserError):
    """A data source or tokenizer that cannot be used."""


class CheckpointError(UserError):
    """A checkpoint that cannot be loaded into this run."""
