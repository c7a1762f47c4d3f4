"""``python -m envfleet.cli``: the ``envfleet`` command line."""

import sys

from envfleet.cli import main

sys.exit(main())
