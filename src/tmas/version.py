"""The package version, in a module of its own so that any layer (the run store included) can read it without
importing the package root and, with it, the public API above."""

__version__ = "0.1.0"
