import sys

from kvfs.cli import main

sys.exit(main())
