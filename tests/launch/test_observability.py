"""The targets file and the scrape config, without a Prometheus (tests/observability/ runs one)."""

from __future__ import annotations

import asyncio
import json

import yaml

from launch.observability.prometheus import RULES, scrape_config
from launch.observability.targets import ObservedDirectory, TargetsFile, target_groups
from proxy.engine import EndpointInfo


def test_targets_label_each_engine_by_the_proxys_name():
    groups = target_groups("http://127.0.0.1:8000", [
        ("decode-0", "decode", "http://10.0.0.2:21003"),
        ("prefill-0", "prefill", "http://10.0.0.1:21000")])
    assert groups == [
        {"targets": ["127.0.0.1:8000"], "labels": {"role": "proxy"}},
        {"targets": ["10.0.0.2:21003"], "labels": {"role": "decode", "pd_engine": "decode-0"}},
        {"targets": ["10.0.0.1:21000"], "labels": {"role": "prefill", "pd_engine": "prefill-0"}},
    ]


def test_the_file_is_rewritten_only_when_the_set_changes(tmp_path):
    f = TargetsFile(tmp_path / "obs" / "targets.json", "http://127.0.0.1:8000")
    engines = [("decode-0", "decode", "http://127.0.0.1:21003")]
    assert f.update(engines) and not f.update(list(engines))
    assert len(json.loads(f.path.read_text())) == 2
    assert f.update([*engines, ("decode-1", "decode", "http://127.0.0.1:21006")])
    assert len(json.loads(f.path.read_text())) == 3
    assert not list(f.path.parent.glob("*.tmp"))


def test_a_ray_directory_keeps_the_file_current(tmp_path):
    class Found:
        infos = [EndpointInfo("prefill-0", "prefill", "http://127.0.0.1:21000")]

        async def endpoints(self):
            return list(self.infos)

    found = Found()
    f = TargetsFile(tmp_path / "targets.json", "http://127.0.0.1:8000")
    directory = ObservedDirectory(found, f)
    assert asyncio.run(directory.endpoints()) == found.infos
    found.infos = [EndpointInfo("prefill-0", "prefill", "http://127.0.0.1:21009")]  # restarted
    asyncio.run(directory.endpoints())
    assert json.loads(f.path.read_text())[1]["targets"] == ["127.0.0.1:21009"]


def test_the_scrape_config_reads_the_targets_and_the_rules(tmp_path):
    config = yaml.safe_load(scrape_config(tmp_path / "targets.json", interval_s=2))
    assert config["global"]["scrape_interval"] == "2s"
    assert config["rule_files"] == [str(RULES)]
    (job,) = config["scrape_configs"]
    assert job["file_sd_configs"][0]["files"] == [str(tmp_path / "targets.json")]
