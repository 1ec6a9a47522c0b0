"""``python -m kvfs.bench ARGS`` is ``kvfs bench ARGS``."""

import sys

from kvfs.cli import main

raise SystemExit(main(["bench", *sys.argv[1:]]))
