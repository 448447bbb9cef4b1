"""`python -m mtc` runs the CLI."""

import sys

from mtc.cli import main

sys.exit(main())
