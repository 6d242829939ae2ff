"""The shipped `ray up` cluster files pass Ray's own config preparation and schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "launch" / "cluster"


@pytest.mark.parametrize("name", ["onprem.yaml", "gpu-aws.yaml"])
def test_cluster_file_is_valid_for_ray(name):
    config = yaml.safe_load((CLUSTER_DIR / name).read_text())
    prepared = prepare_config(config)
    validate_config(prepared)
    start = " ".join(prepared["head_start_ray_commands"])
    assert "ray start --head" in start and "pdserve ray --address auto" in start
    assert any("make -C ~/pdserve-src setup" in c for c in prepared["setup_commands"])
    if name == "gpu-aws.yaml":
        assert "--accelerator gpu" in start and "EXTRAS=gpu" in prepared["setup_commands"][0]
