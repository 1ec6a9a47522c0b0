"""pyfuse3, when installed: the mount needs the ``fuse`` extra, the rest of kvfs does not."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["IMPORT_ERROR", "Operations", "pyfuse3"]

if TYPE_CHECKING:
    import pyfuse3
    import pyfuse3.asyncio

    Operations = pyfuse3.Operations
    IMPORT_ERROR = ""
else:
    try:
        import pyfuse3
        import pyfuse3.asyncio

        Operations = pyfuse3.Operations
        IMPORT_ERROR = ""
    except ImportError as exc:
        pyfuse3 = None
        Operations = object
        IMPORT_ERROR = str(exc)
