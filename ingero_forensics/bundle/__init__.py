"""The bundle format, version 1: schema, container, writer and reader.

This subpackage owns the contract between ingero-capture and the workstation tools;
docs/bundle-format.md is its specification.
"""

from .container import (BUNDLE_SUFFIX, NODE_NAME_RE, bundle_filename, read_manifest,
                        validate_node_name)
from .reader import Bundle, open_bundle
from .schema import FORMAT_VERSION, TABLES, TABLES_BY_NAME
from .writer import BundleWriter, canonical_frames, local_host_facts, now_pair, seal_spool

__all__ = [
    "BUNDLE_SUFFIX", "NODE_NAME_RE", "bundle_filename", "read_manifest", "validate_node_name",
    "Bundle", "open_bundle", "FORMAT_VERSION", "TABLES", "TABLES_BY_NAME",
    "BundleWriter", "canonical_frames", "local_host_facts", "now_pair", "seal_spool",
]
