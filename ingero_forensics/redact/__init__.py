"""Redaction: a copy of fleet.db that may leave the site (``ingero-redact``, ``--redact``)."""

from .core import RedactError, RedactResult, redact_fleet, redacted_input

__all__ = ["RedactError", "RedactResult", "redact_fleet", "redacted_input"]
