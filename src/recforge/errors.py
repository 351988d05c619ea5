"""Errors a user can fix from the command line: shown as one line, without a traceback."""
from __future__ import annotations


class UserInputError(ValueError):
    """Bad input: a config value, a combination, a data file. The message says what was expected."""
