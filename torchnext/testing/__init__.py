"""torchnext.testing."""
