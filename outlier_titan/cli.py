"""Command-line help shared by the scripts: the module docstring as the description, every default shown."""

from __future__ import annotations

import argparse
from typing import Callable

from outlier_titan.errors import UserError, print_error
from outlier_titan.plugins import PLUGINS_HELP


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's layout and appends ``(default: X)`` to every option that has a default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("%(default)" in text or action.default in (None, argparse.SUPPRESS, False, "")
                or action.required or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def parser(doc: str, plugins: bool = False, **kwargs) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` with ``doc`` (a script's module docstring) as its full description; ``plugins``: it
    lists ``--plugins``, which the tool took from its command line first (``plugins.take_plugins``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter, **kwargs)
    if plugins:
        p.add_argument("--plugins", metavar="A,B", help=PLUGINS_HELP)
    return p


def report_user_errors(fn: Callable[..., int], *args) -> int:
    """``fn(*args)``'s exit code; a ``UserError`` becomes the one line ``error: ...`` on stderr and exit code 2."""
    try:
        return fn(*args)
    except UserError as e:
        print_error(f"error: {e}")
        return 2
