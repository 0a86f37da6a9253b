"""The package version, kept in one place for the build backend and the runtime."""

__version__ = "0.1.0"
