"""The one exception a kernel raises for a shape it cannot run."""


class UnsupportedShapeError(ValueError):
    """A Pallas kernel cannot run these shapes or block sizes.

    Raised by a kernel's ``check_supported`` (and so while tracing a call of the kernel). The
    offending parameter and its value are kept as data, so a caller can say what to change
    without parsing the message.

    Attributes:
      field: the parameter, e.g. ``"head_dim"`` or ``"page_size"``.
      value: its value.
    """

    def __init__(self, field: str, value: int, requirement: str) -> None:
        super().__init__(f"{field} must be {requirement}, got {value}")
        self.field = field
        self.value = value
