"""torchnext.demo."""
