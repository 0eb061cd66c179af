"""`python -m pylon.cli ...`: the same CLI as the `pylon` command (the tests run it this way)."""

import sys

from pylon.cli import main

sys.exit(main())
