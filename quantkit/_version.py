"""The package version (a leaf module, so low floors can read it without importing the API)."""

__version__ = "0.1.0"
