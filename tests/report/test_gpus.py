"""GPU index -> rank (docs/bundle-format.md section 8): the GPU-slowdown evidence names
the rank that uses the slow GPU, by the documented rule."""

import json

import pytest

from ingero_forensics.merge import merge_bundles
from ingero_forensics.report import analyze_fleet
from ingero_forensics.report.gpus import gpu_of
from ingero_forensics.simulate import FleetConfig, simulate_fleet


@pytest.mark.parametrize("env, local_rank, gpu", [
    ({"CUDA_VISIBLE_DEVICES": "3"}, 0, "3"),             # one visible device: that one
    ({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 2, "6"),       # cuda:LOCAL_RANK among them
    ({"CUDA_VISIBLE_DEVICES": "4,5"}, None, None),       # several, no local rank
    ({"CUDA_VISIBLE_DEVICES": "GPU-8f0c1e2a"}, 0, None),  # a UUID: unknown
    ({}, 5, "5"),                                        # unset: GPU LOCAL_RANK
    ({}, None, None),
])
def test_documented_rule(env, local_rank, gpu):
    assert gpu_of(json.dumps(env), local_rank) == gpu


def test_gpu_evidence_names_the_rank_on_the_slow_gpu(tmp_path):
    simulate_fleet(tmp_path / "b", FleetConfig(nodes=3, ranks_per_node=4, steps=60,
                                               fault="gpu", straggler=1, seed=3))
    merge_bundles([tmp_path / "b"], tmp_path / "fleet.db")
    truth = json.loads((tmp_path / "b" / "truth.json").read_text())
    (rank,) = truth["fault"]["ranks"]
    gpu = truth["fault"]["detail"]["gpu"]
    a = analyze_fleet(tmp_path / "fleet.db")
    assert a.cause == "gpu", (a.cause, a.verdict)
    line = next(e for e in a.evidence if e.startswith("GPU "))
    assert line.startswith(f"GPU {gpu} (used by rank {rank}) ran at"), line
