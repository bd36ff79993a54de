"""The `smoe` command: one entry point per user action, each a thin call into the packages below."""

from smoe.cli.commands import main

__all__ = ["main"]
