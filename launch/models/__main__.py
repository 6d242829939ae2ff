"""``python -m launch.models {tiny,smollm2} [--out DIR]``: build a model once, print its path.

The path goes to stdout (one line, nothing else); progress goes to stderr.
``--out DIR`` is the cache root (the model lands in ``DIR/<name>``); without it
the root is ``$PDSERVE_CACHE`` or ``~/.cache/pdserve/models``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cache import DEFAULT_MODEL, KNOWN_MODELS, ensure_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.models", description=__doc__.splitlines()[0]
    )
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(KNOWN_MODELS))
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="cache root; the model goes in DIR/<name>",
    )
    args = parser.parse_args(argv)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    print(ensure_model(args.name, cache_dir=args.out, progress=progress), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
