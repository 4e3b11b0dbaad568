"""The coordinator's lifecycle verbs: the runner and one handler per verb (:mod:`.table`)."""

from .runner import VerbRunner

__all__ = ["VerbRunner"]
