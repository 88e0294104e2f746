"""``python -m specdec ...`` is the ``specdec`` command (see :mod:`specdec.cli`)."""

import sys

from specdec.cli import main

if __name__ == "__main__":  # tensor-parallel workers are spawned and import the main module again
    sys.exit(main())
