"""Typed planning errors: what the scheduler raises so upper layers can translate them once."""

from __future__ import annotations


class SchedulerError(Exception):
    """Base class of every error raised by `scheduler/`."""


class UnknownNameError(SchedulerError, KeyError):
    """A named policy, model shape or hardware profile does not exist (a caller's mistake)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ProfileError(SchedulerError, ValueError):
    """A hardware profile file is missing fields or holds impossible values."""


class PlanningError(SchedulerError, ValueError):
    """The requests cannot be planned (duplicate ids, empty prompts, non-positive caps)."""
