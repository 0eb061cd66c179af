"""`python -m pylon ...`: the same CLI as the `pylon` command."""

import sys

from pylon.cli import main

sys.exit(main())
