"""What several `pylon` command groups share: the help formatter, the bundled examples, common help text.

Imports nothing heavy and never `pylon.cli` itself, so every group module can import it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

EXAMPLES_DIR = Path(__file__).parent.parent / "examples"

# Descriptions and epilogs are laid out by hand (examples, one per line): argparse must not rewrap them.
FORMATTER = argparse.RawDescriptionHelpFormatter

ADDRESS_HELP = "dashboard URL (default: RAY_ADDRESS, else the local cluster)"
