"""`python -m jaxengine ...` is the `jaxengine` command."""

import sys

from jaxengine.cli import main

if __name__ == "__main__":
    sys.exit(main())
