"""The package version (a module of its own, so that anything may read it without importing the package's
``__init__``)."""

__version__ = "0.1.0"
