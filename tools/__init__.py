"""kvbridge.tools: the ``kvbridge`` command line."""

from .cli import main

__all__ = ["main"]
