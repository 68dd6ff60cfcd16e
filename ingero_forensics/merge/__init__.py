"""ingero-merge: node bundles -> one fleet.db (stack dedup, clock-skew alignment)."""

from .core import MergeResult, merge_bundles
from .files import MergeError, expand_inputs, list_bundles

__all__ = ["MergeError", "MergeResult", "expand_inputs", "list_bundles", "merge_bundles"]
