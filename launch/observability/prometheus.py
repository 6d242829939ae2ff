"""A Prometheus for a deployment: its config (scrape the targets file every few seconds, load
the recording rules) and, for ``pdserve dev --observability``, the server itself (Debian's
``prometheus`` package, or any ``prometheus`` on the PATH), started and stopped with the stack.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

from launch.reaper import popen_dying_with_us

HERE = Path(__file__).parent
RULES = HERE / "rules.yml"
DASHBOARD = HERE / "dashboard.json"


def scrape_config(targets_file: Path, interval_s: float = 5.0, rules: Path = RULES) -> str:
    """prometheus.yml: one job over the deployment's targets file (proxy and engines alike)."""
    return yaml.safe_dump({
        "global": {"scrape_interval": f"{interval_s:g}s",
                   "evaluation_interval": f"{interval_s:g}s"},
        "rule_files": [str(rules)],
        "scrape_configs": [{
            "job_name": "pdserve",
            "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "5s"}],
        }],
    }, sort_keys=False)


def binary() -> str | None:
    return shutil.which("prometheus") or next(
        (p for p in ("/usr/bin/prometheus", "/usr/local/bin/prometheus") if Path(p).exists()),
        None)


def require_binary() -> str:
    """The ``prometheus`` binary's path; FileNotFoundError, saying how to get one, if none."""
    exe = binary()
    if exe is None:
        raise FileNotFoundError("no prometheus binary (--observability runs one): apt-get "
                                "install prometheus (Debian), or put one on the PATH")
    return exe


class Prometheus:
    """A Prometheus server process; :meth:`stop` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, workdir: Path, targets_file: Path, host: str = "127.0.0.1",
                 port: int = 9090, interval_s: float = 5.0):
        exe = require_binary()
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(scrape_config(targets_file, interval_s))
        self.url = f"http://{host}:{port}"
        self.log_path = workdir / "prometheus.log"
        with open(self.log_path, "ab") as log:
            # Stopped with the deployment, and with this process however it ends.
            self.popen = popen_dying_with_us(
                [exe, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
                 f"--web.listen-address={host}:{port}", "--web.enable-lifecycle"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.popen.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.popen.returncode}; see "
                                   f"{self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready in {timeout_s:.0f}s; see "
                                   f"{self.log_path}")
            time.sleep(0.5)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
