"""``launch/install.py``: uv is given the package sources pip is configured with."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "install.py"
_spec = importlib.util.spec_from_file_location("install_script", SCRIPT)
install = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(install)

# ``pip config list`` as pip 23-25 print it: this box's user and global files, and the env.
BOX = """\
:env:.cert='/etc/ssl/certs/ca-certificates.crt'
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
"""


def test_this_boxs_sources_reach_uv():
    argv, env = install.uv_command("uv", "/v/bin/python", ".[cpu]",
                                   install.pip_settings(BOX))
    assert argv[:4] == ["uv", "pip", "install", "--python"]
    pairs = list(zip(argv, argv[1:]))
    assert ("--extra-index-url", "file:///opt/pypi/simple") in pairs
    assert ("--extra-index-url", "file:///opt/pypi-more/simple") in pairs
    assert ("--find-links", "/opt/wheels") in pairs
    assert ("--constraint", "/etc/xdg/pip/constraints.txt") in pairs
    assert ("--index-strategy", "unsafe-best-match") in pairs  # pip's best version, any index
    assert "--compile-bytecode" in argv
    assert "--index-url" not in argv  # pip's default index: uv's default too
    assert argv[-2:] == ["-e", ".[cpu]"]
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
                   "UV_HTTP_TIMEOUT": "180"}  # (PIP_DEFAULT_TIMEOUT: default-timeout)


def test_a_list_written_over_several_lines_gives_each_entry():
    """pip.conf's usual way to list indexes, a value on each line after the key: pip lists
    it with ``\\n``s inside."""
    listed = ("global.extra-index-url='\\nhttps://a/simple\\nhttps://b/simple'\n"
              "global.find-links='\\n/w1\\n/w2'\n")
    argv, _ = install.uv_command("uv", "py", ".", install.pip_settings(listed))
    pairs = list(zip(argv, argv[1:]))
    assert ("--extra-index-url", "https://a/simple") in pairs
    assert ("--extra-index-url", "https://b/simple") in pairs
    assert ("--find-links", "/w1") in pairs and ("--find-links", "/w2") in pairs


def test_the_environment_wins_over_the_install_section_over_global():
    listed = ("global.index-url='https://g/simple'\n"
              "install.index-url='https://i/simple'\n"
              ":env:.index-url='https://e/simple'\n"
              "global.extra-index-url='https://g2/simple'\n"
              "install.extra-index-url='https://i2/simple'\n")
    settings = install.pip_settings(listed)
    assert settings["index-url"] == "https://e/simple"
    assert settings["extra-index-url"] == "https://i2/simple"  # replaced, not merged (pip)


def test_a_nodes_proxy_and_timeout_reach_uv_as_its_environment():
    """A ``ray up`` node's pip reaches PyPI through ``PIP_PROXY`` (launch/ssh_node.py): uv
    reads ``HTTPS_PROXY`` instead."""
    settings = install.pip_settings(":env:.proxy='http://10.0.0.1:3128'\n:env:.timeout='60'\n"
                                    "global.somethingelse='x'\nnot a setting\n")
    _, env = install.uv_command("uv", "py", ".", settings)
    assert env == {"HTTPS_PROXY": "http://10.0.0.1:3128", "HTTP_PROXY": "http://10.0.0.1:3128",
                   "UV_HTTP_TIMEOUT": "60"}


def test_it_reads_the_pip_config_list_of_this_machine():
    """The format parsed is the installed pip's own."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                            capture_output=True, text=True, check=True).stdout
    settings = install.pip_settings(listed)
    for line in listed.splitlines():
        key = line.partition("=")[0].rpartition(".")[2]
        if key in install._KEYS:
            assert key in settings
