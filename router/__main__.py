"""`python -m router ...`: the router alone (same flags as `pdserve router`)."""

import sys

from router.cli import main

sys.exit(main())
