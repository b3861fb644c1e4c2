"""`make demo`: the embedded default model on a few chat prompts with continuous batching."""

import sys


def main() -> int:
    print(
        "jaxengine demo: the engine is not built yet (see the engine issue). "
        "`make test` runs what exists so far.",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
