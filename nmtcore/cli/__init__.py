"""The command lines: ``nmtcore`` (:mod:`~nmtcore.cli.main`) and the sweep entry points' shared one
(:mod:`~nmtcore.cli.sweep`)."""

from nmtcore.cli.main import main

__all__ = ["main"]
