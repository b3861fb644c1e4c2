"""The engine's configuration: `SpeculativeConfig`.

A low layer: it imports nothing from jaxengine's other packages, only the `scheduler` package.
"""

from jaxengine.config.speculative import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
