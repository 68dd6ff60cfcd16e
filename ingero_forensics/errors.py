"""Exception types. The CLIs turn any IngeroError into one line on stderr and exit 1 (2 for
cliutil.BadUsage, a usage error that shows only once the inputs are looked at)."""


class IngeroError(Exception):
    """Base class for every error the tools report to users."""


class BundleError(IngeroError):
    """A bundle (or a file offered as one) is unusable; names the file and the reason."""

    def __init__(self, path, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


class DiskFullError(IngeroError):
    """Writing stopped because the file system is full."""
