"""One deployment config (``launch/settings.py``): the shared flags of ``pdserve dev`` and
``pdserve ray`` come from its fields, its defaults are the proxy's and the connector's own,
bad values are refused at the edge, and every flag the READMEs name exists."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from launch import cli
from launch.engines import EngineSpec, default_dtype
from launch.ray_engine import EngineTemplate
from launch.settings import EngineSettings, ProxySettings, add_arguments, flags, from_args
from proxy.config import ProxyConfig
from transport.connector import ConnectorOptions

ROOT = Path(__file__).resolve().parents[2]
#: vLLM's own engine flags the READMEs mention (pdserve sets them; it does not take them).
VLLM_FLAGS = {"--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-transfer-config",
              "--request-id-prefix"}  # (the last: `vllm bench serve`)
PACKAGES = ("prefill", "decode", "proxy", "transport", "launch", "harness")
WIRING = dict(decode_urls=("http://d",), served_model_names=("m",), kv_bytes_per_token=10)


def parsers() -> dict[str, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    for add in (cli._add_dev, cli._add_ray, cli._add_scale, cli._add_plan):
        add(sub)
    return dict(sub.choices)


def test_every_field_is_a_flag_of_both_modes_with_its_help():
    for settings in (EngineSettings, ProxySettings):
        for name, field in settings.model_fields.items():
            assert field.description, f"{settings.__name__}.{name} has no help"
        for mode in ("dev", "ray"):
            text = parsers()[mode].format_help()
            for flag in flags(settings):
                assert flag in text, (mode, flag)


def test_defaults_are_the_proxys_and_the_connectors():
    """Nothing is restated: settings left alone give the config the proxy would build itself."""
    assert ProxySettings().config(**WIRING, kv_lease_s=ConnectorOptions.lease_s) == \
        ProxyConfig(**WIRING)
    assert EngineSettings().connector(cpu_fixes=False) == ConnectorOptions()
    spec = EngineSpec("decode", "m", "m", 1, 2)
    assert (spec.kv_cache_gib, spec.max_model_len) == (
        EngineSettings().kv_cache_gib, EngineSettings().max_model_len)
    assert EngineTemplate("tiny", "t").engines == EngineSettings()


@pytest.mark.parametrize("mode", ["dev", "ray"])
def test_flags_round_trip_into_the_settings(mode):
    args = parsers()[mode].parse_args([
        "--kv-cache-gib", "3", "--offload-gib", "1.5", "--offload-eviction", "arc",
        "--kv-blocks", "40", "--engine-dev-endpoints", "--policy", "threshold:512",
        "--slo-itl-ms", "80", "--probe-tokens", "", "--idle-deadline-s", "7",
        "--private-ops", "--port", "9001"])
    engines, proxy = from_args(EngineSettings, args), from_args(ProxySettings, args)
    assert engines == EngineSettings(kv_cache_gib=3, offload_gib=1.5, offload_eviction="arc",
                                     kv_blocks=40, engine_dev_endpoints=True)
    assert engines.vllm_args() == ("--num-gpu-blocks-override", "40")
    config = proxy.config(**WIRING)
    assert (config.policy, config.slo_itl_ms, config.probe_tokens, config.idle_deadline_s,
            config.public_health, proxy.port) == ("threshold:512", 80.0, (), 7.0, False, 9001)


@pytest.mark.parametrize("argv, named", [
    (["dev", "--policy", "sometimes"], "policy"),
    (["dev", "--max-inflight", "0"], "max_inflight"),
    (["ray", "--slo-ttft-ms", "-5"], "slo_ttft_ms"),
    (["dev", "--kv-cache-gib", "0"], "kv_cache_gib"),
])
def test_bad_values_are_refused_before_anything_starts(argv, named, capsys, monkeypatch):
    started = []
    monkeypatch.setattr("launch.models.ensure_model", lambda *a, **k: started.append(a))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error:") and named in err
    assert not started


def test_a_list_flag_that_is_not_one_is_a_usage_error(capsys):
    with pytest.raises(SystemExit):
        parsers()["dev"].parse_args(["--probe-tokens", "64,lots"])
    assert "not a comma-separated list of integers" in capsys.readouterr().err


def test_the_api_key_falls_back_to_the_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    _, proxy = cli._settings(parsers()["dev"].parse_args([]))
    assert proxy.api_key == "from-env"
    _, proxy = cli._settings(parsers()["dev"].parse_args(["--api-key", "given"]))
    assert proxy.api_key == "given"


def test_every_flag_the_readmes_name_exists():
    known = set(VLLM_FLAGS) | {"--help"}
    for p in parsers().values():
        for action in p._actions:
            known.update(action.option_strings)
    # (benchmarks/ and tests/ name the benchmarks' and pytest's own flags)
    for readme in [ROOT / "README.md", *(ROOT / package / "README.md" for package in PACKAGES)]:
        for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", readme.read_text())):
            assert flag in known, f"{readme.relative_to(ROOT)} names {flag}, no command has it"


def test_add_arguments_types():
    p = argparse.ArgumentParser()
    add_arguments(p, EngineSettings)
    args = p.parse_args(["--max-model-len", "2048", "--offload-fs-dir", "/x"])
    assert args.max_model_len == 2048 and args.offload_fs_dir == "/x"
    with pytest.raises(SystemExit):
        p.parse_args(["--offload-eviction", "fifo"])


def test_a_renamed_flag_keeps_working_under_its_old_name_and_says_so(capsys):
    p = argparse.ArgumentParser()
    add_arguments(p, ProxySettings)
    assert p.parse_args([]).headers_deadline_s == ProxySettings().headers_deadline_s
    assert "deprecated" not in capsys.readouterr().err
    old = p.parse_args(["--first-byte-deadline-s", "7.5"])
    assert old.headers_deadline_s == 7.5
    assert "--first-byte-deadline-s is deprecated, use --headers-deadline-s" in (
        capsys.readouterr().err)
    assert from_args(ProxySettings, old).config(
        decode_urls=["http://d"], kv_bytes_per_token=1, served_model_names=["m"],
    ).deadlines().headers_s == 7.5
    assert p.parse_args(["--headers-deadline-s", "3"]).headers_deadline_s == 3.0


def test_cpu_engines_default_to_float32_even_with_amx():
    """bf16 on the CPU changed answers (README, Platform notes): float32 unless asked."""
    assert default_dtype("cpu") == "float32"
    assert default_dtype("cuda") == "bfloat16"
    assert default_dtype("cpu", "bfloat16") == "bfloat16"
    for mode in ("dev", "ray"):
        args = parsers()[mode].parse_args(["--dtype", "bfloat16"])
        assert from_args(EngineSettings, args).dtype == "bfloat16"


@pytest.mark.parametrize("argv, named", [
    (["--engine-base-port", "65535"], "out of range 1-65535"),  # the decode engine on 65536
    (["--port", "29101"], "29101 (proxy and decode engine)"),
    (["--engine-base-port", "29199"], "29200 (decode engine and prefill NIXL side channel)"),
    (["--kv-events-base-port", "29301"], "29301 (proxy and prefill KV events)"),
    (["--link-mbit", "100", "--kv-events-base-port", "29199"],
     "29200 (prefill NIXL side channel and decode KV events)"),
    (["--headers-deadline-s", "700"], "total_deadline_s must be >= headers_deadline_s"),
    (["--model", "someorg/somemodel"], "not a local model directory"),
    (["--observability", "--prometheus-port", "29399"], "no prometheus binary"),
])
def test_dev_flags_that_cannot_work_are_refused_before_any_engine_starts(argv, named, capsys,
                                                                         monkeypatch):
    """Each used to be found only once the engines had loaded (minutes), or as a traceback."""
    from launch import dev
    from launch.models import ensure_model

    started = []
    monkeypatch.setattr(dev, "start_engine", lambda *a, **k: started.append(a))
    monkeypatch.setattr("launch.observability.prometheus.binary", lambda: None)
    base = ["dev", "--model", str(ensure_model("tiny")), "--port", "29301",
            "--engine-base-port", "29100", "--side-channel-base-port", "29200",
            "--kv-events-base-port", "29210"]
    assert cli.main(base + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve: error:") and named in err, err
    assert not started
