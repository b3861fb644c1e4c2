"""The one exception a kernel raises for a shape it cannot run."""


class UnsupportedShapeError(ValueError):
    """A Pallas kernel cannot handle these shapes or block sizes (the dispatcher falls back).

    Raised at trace time, with a message naming the value and what it must be.
    """
