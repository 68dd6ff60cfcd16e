"""ingero-simulate: realistic multi-node fleets written as real bundles, with ground truth.

``simulate_fleet(out_dir, FleetConfig(...))`` writes one bundle per node through the real
BundleWriter and ``truth.json`` beside them. The timing and clock model is described in
docs/simulator.md.
"""

from .config import FAULTS, FleetConfig, SimulateConfigError, node_name, parse_node, parse_window
from .fleet import TRUTH_NAME, FleetTruth, simulate_fleet

__all__ = ["FAULTS", "FleetConfig", "SimulateConfigError", "node_name", "parse_node",
           "parse_window", "TRUTH_NAME", "FleetTruth", "simulate_fleet"]
