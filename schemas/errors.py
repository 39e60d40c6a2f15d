"""The project's exception root: every error rlstream raises on purpose derives from
``RlstreamError``, so a caller can tell "rlstream refused or could not do this, and says why"
from a bug (``except RlstreamError``), and still catch a family by its own class.

Rules:
- one class per kind of failure, defined once, in the lowest layer that raises it (the codec's
  ``DeltaError``, the events' ``EventError``, the producer's ``DeliveryError`` ...); a class
  keeps the built-in base callers already catch it by (``ValueError`` for bad input,
  ``RuntimeError`` for a broken environment) beside ``RlstreamError``;
- ``Refused`` is the one "input refused, here is why" (a record a processor will not take,
  which the transactional loop dead-letters; a weight manifest whose signature does not
  verify); ``SetupError`` the one "fix this on your machine" (missing Java or Maven, a failed
  download, a cluster that cannot start).

The sandbox's bootstrap (``envs/sandbox/boot.py``) runs standalone with the standard library
only, so it keeps a private exception of its own, which never leaves its process.
"""

from __future__ import annotations

from typing import Any


class RlstreamError(Exception):
    """The root of every error rlstream raises on purpose."""


class Refused(RlstreamError, ValueError):
    """An input refused, with the reason (``reason``) and, when it is one record of a batch,
    that record (``record``: the transactional loop dead-letters it as ``invalid_record`` and
    goes on with the others). ``Refused(reason)`` refuses one input, ``Refused(record,
    reason)`` one record of a batch."""

    def __init__(self, record: Any, reason: str | None = None) -> None:
        if reason is None:
            record, reason = None, str(record)
        super().__init__(reason)
        self.record, self.reason = record, reason


class SetupError(RlstreamError, RuntimeError):
    """Something the user must fix on their machine (missing Java or Maven, a failed download,
    a local cluster that cannot start), said in words they can act on."""


#: The exit status of a command or role whose configuration is refused (invalid, or not its
#: run's): ``ops.run.supervise`` never restarts a role that exits so.
CONFIG_EXIT = 2


class ConfigInvalid(RlstreamError, ValueError):
    """A recipe (or its ``--set`` values) that does not make a valid config; ``problems`` are
    ``key: message`` lines, one per error, and ``source`` names the recipe."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(problems))
        self.source = source
        self.problems = problems
