"""torchnext.lowp."""
