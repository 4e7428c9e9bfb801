"""torchnext.control."""
