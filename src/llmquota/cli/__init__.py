"""The `llmquota` command line."""

from llmquota.cli.main import main

__all__ = ["main"]
