"""``python -m envfleet.cli``: the ``envfleet`` command line."""

import sys

from envfleet.cli import main

__all__: list[str] = []  # run, not imported

sys.exit(main())
