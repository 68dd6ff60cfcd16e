"""ingero-merge: node bundles -> one fleet.db (stack dedup, clock-skew alignment)."""

from .core import MergeError, MergeResult, expand_inputs, list_bundles, merge_bundles

__all__ = ["MergeError", "MergeResult", "expand_inputs", "list_bundles", "merge_bundles"]
