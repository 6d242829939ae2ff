"""Build-once cache of the locally made models ("tiny", "smollm2").

Contract of ``ensure_model(name, cache_dir=None, progress=None)``:
- ``name`` in ``KNOWN_MODELS`` ("tiny", "smollm2"): the model is built once into
  ``<root>/<name>`` and that path is returned; ``root`` is ``cache_dir``, else
  ``$PDSERVE_CACHE``, else ``~/.cache/pdserve/models``. Known names win over a
  same-named directory in the working directory.
- The build runs in a temporary directory next to the target (same filesystem)
  and is renamed into place only after the builder returned and the marker file
  ``.pdserve-model.json`` was written, so a half-built directory is never
  returned. A directory without a matching marker (crashed build, or an older
  recipe version) is rebuilt. Concurrent callers serialise on a lock file in the
  root; the losers wait and then reuse the winner's build.
- Any other ``name`` that is an existing directory is returned as a ``Path``,
  unchanged; anything else is taken to be a hub id and returned as the string
  (vLLM resolves it).

``model_config(name, hub_cache=None)``: the ``config.json`` of a model this node has (a
directory's, or a hub id's in the Hugging Face cache once vLLM downloaded it), else None.

``same_on_every_node(name, built, link_dir)``: for engines on several nodes (Ray mode), a path to a
known model's build that reads the same on every node, whatever its home: NIXL's handshake
hashes the model's path string (vLLM's ``compute_nixl_compatibility_hash``), and a prefill
and a decode engine whose nodes keep the build under different homes refuse each other's KV
("NIXL compatibility hash mismatch"; the decode engine then recomputes every prompt).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .smollm2 import convert_smollm2
from .tiny import build_tiny_model

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]
Builder = Callable[..., Path]

DEFAULT_MODEL = "smollm2"
KNOWN_MODELS: dict[str, Builder] = {"tiny": build_tiny_model, "smollm2": convert_smollm2}
#: Bump a model's number when its recipe changes: cached builds of older numbers are rebuilt.
RECIPE_VERSIONS: dict[str, int] = {"tiny": 1, "smollm2": 1}
MARKER_FILE = ".pdserve-model.json"
CACHE_ENV = "PDSERVE_CACHE"


def default_cache_root() -> Path:
    """``$PDSERVE_CACHE`` if set, else ``~/.cache/pdserve/models``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve" / "models"


def ensure_model(
    name: str, cache_dir: Path | None = None, progress: Progress | None = None
) -> Path | str:
    """Return a loadable model: a built cache dir, an existing dir, or a hub id string."""
    if name in KNOWN_MODELS:
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
        return _ensure_built(name, root, progress)
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    return name


def model_config(name: str, hub_cache: Path | None = None) -> Path | None:
    """The ``config.json`` of ``name`` on this node: a directory's own, or a hub id's from the
    Hugging Face cache (``hub_cache``, else the environment's, as vLLM's own download uses)
    once something downloaded it, as an engine does before it is ready. None when absent."""
    if Path(name).expanduser().is_dir():
        config = Path(name).expanduser() / "config.json"
        return config if config.is_file() else None
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json", cache_dir=hub_cache)
    except ValueError:  # not a repository id either (a path missing on this node, say)
        return None
    return Path(found) if isinstance(found, str) else None


def same_on_every_node(name: str, built: Path | str, link_dir: Path) -> Path | str:
    """For a known model, ``<link_dir>/<name>-r<recipe>``: a link to this node's ``built``,
    replaced atomically (engines starting side by side on one node agree). ``link_dir`` must
    be a private directory whose path is the same on every node (Ray engines:
    ``/tmp/pdserve-<uid>/models``). Anything else is returned unchanged: a path given is the
    same on every node already, a hub id is a name."""
    if name not in KNOWN_MODELS:
        return built
    link_dir.mkdir(exist_ok=True)
    link = link_dir / f"{name}-r{RECIPE_VERSIONS[name]}"
    target = str(Path(built).resolve())
    if not (link.is_symlink() and os.readlink(link) == target):
        staging = link_dir / f".{link.name}.{os.getpid()}"
        staging.unlink(missing_ok=True)
        staging.symlink_to(target)
        os.replace(staging, link)
    return link


def is_complete(model_dir: Path, name: str) -> bool:
    """True when ``model_dir`` holds a finished build of ``name`` at the current recipe version."""
    try:
        marker = json.loads((Path(model_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("name") == name and marker.get("recipe") == RECIPE_VERSIONS[name]


def _report(progress: Progress | None, message: str) -> None:
    logger.info(message)
    if progress is not None:
        progress(message)


@contextlib.contextmanager
def _build_lock(root: Path, name: str, progress: Progress | None) -> Iterator[None]:
    with open(root / f".{name}.lock", "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _report(progress, f"{name}: another process is building it; waiting")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _ensure_built(name: str, root: Path, progress: Progress | None) -> Path:
    target = root / name
    if is_complete(target, name):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _build_lock(root, name, progress):
        if is_complete(target, name):  # built by another process while we waited
            return target
        for leftover in root.glob(f".{name}.building-*"):  # crashed builds; we hold the lock
            shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=root))
        try:
            started = time.monotonic()
            _report(progress, f"{name}: building into {target}")
            KNOWN_MODELS[name](staging, progress=progress)
            marker = {"name": name, "recipe": RECIPE_VERSIONS[name], "built_at": time.time()}
            (staging / MARKER_FILE).write_text(json.dumps(marker) + "\n")
            _make_readable(staging)
            _replace_dir(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _report(progress, f"{name}: ready in {time.monotonic() - started:.1f}s at {target}")
    return target


def _make_readable(directory: Path) -> None:
    """Make a build world-readable (mkdtemp and safetensors create 0700/0600 entries)."""
    directory.chmod(0o755)
    for path in directory.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _replace_dir(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``, first moving a stale ``target`` aside."""
    if target.exists() or target.is_symlink():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        os.rename(target, stale / target.name)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(staging, target)
