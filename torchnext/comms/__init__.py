"""torchnext.comms."""
