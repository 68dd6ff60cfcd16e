"""ingero-forensics: offline forensics for distributed GPU training on air-gapped clusters.

Data flows one way: capture -> bundle -> merge -> fleet.db -> export / report.
"""

__version__ = "0.1.0"
