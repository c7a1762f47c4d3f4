"""``python -m envfleet``: the ``envfleet`` command line (also the console script's entry).

The command line needs the ``cli`` extra (rich for its tables and progress, matplotlib for
``bench``'s plot); without it, this says which ``pip install`` to run instead of
failing on an import.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

CLI_PACKAGES = ("rich", "matplotlib")
"""What ``envfleet[cli]`` installs on top of the library (see ``pyproject.toml``)."""


def missing_cli_packages() -> list[str]:
    """The packages of the ``cli`` extra that are not installed."""
    return [name for name in CLI_PACKAGES if importlib.util.find_spec(name) is None]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``envfleet`` command line; return the exit status."""
    missing = missing_cli_packages()
    if missing:
        sys.stderr.write(
            f"envfleet: error: the command line needs {', '.join(missing)}: "
            "pip install 'envfleet[cli]'\n"
        )
        return 2
    from envfleet.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
