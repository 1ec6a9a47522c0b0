"""``python -m kvfs.bench``: run a comparison (see ``kvfs.bench.compare``)."""

from .compare import main

raise SystemExit(main())
