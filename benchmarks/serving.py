"""The serving benchmark (no speculation, chain snapshot, tree snapshot, tree WY) on the shipped
tiny models: ``python -m benchmarks.serving [--json out.json]``, the same as
``python -m serving bench`` (see ``serving/bench.py``; ``--help`` lists the options)."""

import sys

from serving.cli import main

if __name__ == "__main__":
    main(["bench", *sys.argv[1:]])
