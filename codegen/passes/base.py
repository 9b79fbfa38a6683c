"""Pass protocol: ``requires() -> call() -> ensures()``; ``ensures`` raises when a pass broke its promise."""
from __future__ import annotations

from ..ir import Partition


class InvariantError(AssertionError):
    """A pass did not establish the invariant the next pass relies on (a codegen bug)."""


class EpiloguePass:
    """One rewrite of a ``Partition``.  Subclasses name their ``dependencies`` (pass classes that
    must have run before) and override ``call``; ``requires``/``ensures`` check invariants."""

    dependencies: tuple[type["EpiloguePass"], ...] = ()

    @property
    def name(self) -> str:
        return type(self).__name__

    def requires(self, partition: Partition) -> None:
        """Raise ``InvariantError`` when ``partition`` is not a valid input."""

    def call(self, partition: Partition) -> Partition:
        raise NotImplementedError

    def ensures(self, partition: Partition) -> None:
        """Raise ``InvariantError`` when the result breaks this pass's promise."""

    def __call__(self, partition: Partition) -> Partition:
        self.requires(partition)
        result = self.call(partition)
        self.ensures(result)
        return result
