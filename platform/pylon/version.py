"""The version of Pylon, in one place (the distribution's metadata says the same: pyproject.toml)."""

__version__ = "0.1.0"
