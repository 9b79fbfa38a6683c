"""The one exception kind the codegen raises for partitions it leaves to TVM."""


class Unsupported(Exception):
    """The partition cannot be offloaded; ``reason`` says why (shown to the user, never silent)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason
