"""The package version (one place; the package root and the preset writer read it)."""

__version__ = "0.1.0.dev0"
