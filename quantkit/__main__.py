"""``python -m quantkit ...``: the same command line as the ``quantkit`` script."""

from __future__ import annotations

import sys

from quantkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
