"""The one error type a checkpoint problem surfaces as: a message a person can act on, no traceback soup."""


class CheckpointError(Exception):
    """A checkpoint cannot be loaded: says which file, which tensor, and expected vs found where it applies."""

    def __init__(self, message: str, *, path: str | None = None, tensor: str | None = None) -> None:
        parts = []
        if path:
            parts.append(str(path))
        if tensor:
            parts.append(f"tensor {tensor!r}")
        super().__init__(": ".join(parts + [message]) if parts else message)
        self.path = path
        self.tensor = tensor
