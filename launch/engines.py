"""The command line and environment of one vLLM engine process, for either role.

Only ``launch`` decides ports, cores and devices; the role packages add their own arguments and
``transport`` the connector config.
"""

from __future__ import annotations

import glob
import os
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import decode.role
import prefill.role
from launch.engine_guard import KEY_ENV, EngineGuard
from launch.settings import EngineSettings
from transport.connector import ConnectorOptions, Role, kv_transfer_config_json
from transport.kv_events import kv_events_config

ENGINE_DEFAULTS = EngineSettings()

Device = Literal["cpu", "cuda"]


#: UCX transports the KV takes (``UCX_TLS``; a value in the launcher's environment wins). UCX
#: picks per peer from the list: ``cma`` (``process_vm_readv``) reaches engines on this kernel,
#: ``tcp`` the others (and wires ``cma`` up: it cannot stand alone). NIXL moved a same-node
#: pair's KV 4.6x faster with it (``benchmarks/nixl_link.py``: 4.43 against 0.97 GB/s).
UCX_TLS = "tcp,cma,self"
#: Over the throttled-link testbed's veth: ``cma`` would bypass the link being measured.
UCX_TLS_TCP = "tcp,self"
#: A GPU's KV is device memory, which no host transport above can read. There UCX keeps its
#: own default, every transport (``cuda_ipc`` between GPUs of one node, RDMA where the node has
#: it, ``tcp`` staged through ``cuda_copy`` otherwise), as vLLM's NIXL guide sets it. Reasoned
#: from UCX's transports; this machine has no GPU to run it.
UCX_TLS_GPU = "all"
UCX_TLS_GPU_TCP = "tcp,cuda_copy,self"
#: Where a node lists its RDMA ports (``mlx5_0`` port 1 is UCX's ``mlx5_0:1``).
RDMA_SYSFS = "/sys/class/infiniband"


def default_ucx_tls(device: Device, tcp_only: bool = False) -> str:
    """The UCX transports an engine on ``device`` takes (``tcp_only``: over a link being
    measured, nothing that bypasses it)."""
    if device == "cuda":
        return UCX_TLS_GPU_TCP if tcp_only else UCX_TLS_GPU
    return UCX_TLS_TCP if tcp_only else UCX_TLS


def rdma_ports(root: str | None = None) -> list[str]:
    """This node's RDMA ports, as UCX names them (``mlx5_0:1``); none without RDMA."""
    root = root or RDMA_SYSFS
    try:
        return [f"{dev}:{port}" for dev in sorted(os.listdir(root))
                for port in sorted(os.listdir(os.path.join(root, dev, "ports")))]
    except OSError:
        return []


@dataclass(frozen=True)
class EngineSpec:
    role: Role
    model: str
    served_model_name: str
    port: int
    side_channel_port: int
    host: str = "127.0.0.1"
    device: Device = "cpu"
    #: CPU: the cores this engine's OpenMP threads bind to ("0", "1", "0-3"); None = vLLM's choice.
    cpu_cores: str | None = None
    #: CPU: KV cache size in whole GiB (vLLM reads an int). GPU: share of device memory (two
    #: engines share one GPU in dev).
    kv_cache_gib: int = ENGINE_DEFAULTS.kv_cache_gib
    gpu_memory_utilization: float = 0.4
    dtype: str = "auto"
    max_model_len: int = ENGINE_DEFAULTS.max_model_len
    connector: ConnectorOptions = field(default_factory=ConnectorOptions)
    #: Publish KV cache events (ZMQ) on this port, for the proxy's prefix index.
    kv_events_port: int | None = None
    #: Run inside this network namespace (the throttled-link testbed).
    netns: str | None = None
    #: The interface UCX moves KV over (loopback by default for a 127.x host).
    ucx_device: str | None = None
    #: The UCX transports; None: the device's (``default_ucx_tls``).
    ucx_tls: str | None = None
    #: Expose vLLM's dev endpoints (/reset_prefix_cache, ...): testbeds and benchmarks only.
    dev_endpoints: bool = False
    extra_args: tuple[str, ...] = ()
    #: Environment variables set for this engine on top of the launcher's own.
    extra_env: tuple[tuple[str, str], ...] = ()
    #: The deployment's secret: every path but /health and /metrics needs it
    #: (``launch/engine_guard.py``). None: the engine is open to anyone who reaches it.
    api_key: str | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def kv_events_endpoint(self) -> str | None:
        """Where subscribers connect for this engine's KV events.

        The events carry prompts' token ids. vLLM's publisher binds TCP only on every interface
        (``tcp://*:port``; a narrower address makes it connect instead), so an engine on
        loopback publishes on a Unix socket in a directory only this user may enter
        (:func:`private_socket_dir`), and one on a node address on ``*:port``."""
        if self.kv_events_port is None:
            return None
        if self.loopback:
            return f"ipc://{private_socket_dir()}/kv-events-{self.kv_events_port}"
        return f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def kv_events_bind(self) -> str | None:
        """The publisher's own endpoint (``--kv-events-config``)."""
        if self.kv_events_port is None or self.loopback:
            return self.kv_events_endpoint
        return f"tcp://*:{self.kv_events_port}"


def is_loopback(host: str) -> bool:
    return host.startswith("127.") or host == "localhost"


def private_socket_dir(root: Path = Path("/tmp")) -> Path:
    """``/tmp/pdserve-<uid>``: this user's Unix sockets and model links; refused when another
    user owns it or may enter it (a planted directory would let them read or impersonate the
    publishers, or swap a model)."""
    path = root / f"pdserve-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be a directory of user {os.getuid()} with mode 0700")
    return path


#: vLLM 0.32's KV block size when none is given: 128 tokens on the CPU platform (non-MLA
#: attention), 16 on CUDA.
DEFAULT_BLOCK_TOKENS: dict[str, int] = {"cpu": 128, "cuda": 16}


def check_kv_capacity(device: Device, max_model_len: int, kv_blocks: int | None,
                      kv_cache_gib: int, kv_bytes_per_token: int | None) -> None:
    """Refuse, before any engine starts, a KV cache that cannot hold one request of the
    maximum length: vLLM would fail at start-up with the reason 20 lines up its log."""
    if kv_blocks is not None:
        block = DEFAULT_BLOCK_TOKENS[device]
        if kv_blocks * block < max_model_len:
            need = -(-max_model_len // block)
            raise ValueError(
                f"--kv-blocks {kv_blocks} holds {kv_blocks * block} tokens ({block} per block "
                f"on {device}), less than one request of --max-model-len {max_model_len}: give "
                f"at least {need} blocks or a smaller --max-model-len")
    if device == "cpu" and kv_bytes_per_token:
        tokens = kv_cache_gib * 2**30 // kv_bytes_per_token
        if tokens < max_model_len:
            raise ValueError(
                f"--kv-cache-gib {kv_cache_gib} holds {tokens} tokens of this model's KV "
                f"({kv_bytes_per_token} bytes each), less than one request of --max-model-len "
                f"{max_model_len}")


def detect_device() -> Device:
    """``cuda`` when torch sees a GPU. A machine without a GPU's device node (``/dev/nvidiaN``,
    or WSL's ``/dev/dxg``) has none, and is answered without importing torch (~2 s of every
    start here)."""
    if not glob.glob("/dev/nvidia[0-9]*") and not os.path.exists("/dev/dxg"):
        return "cpu"
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # torch missing or broken: the CPU build is what we can run
        return "cpu"


def default_dtype(device: Device, requested: str = "auto") -> str:
    """The engines' dtype: ``requested`` unless it is ``auto``; then bf16 on a GPU and float32
    on a CPU. bf16 is not the CPU default even where AMX makes it native: on such a machine
    (Xeon with amx_bf16), SmolLM2-135M in bf16 no longer answered "What is the capital of
    France?" with Paris, and greedy answers of concurrent streams moved with batch makeup
    (README, Platform notes). ``--dtype bfloat16`` asks for it anyway."""
    if requested != "auto":
        return requested
    return "bfloat16" if device == "cuda" else "float32"


def engine_argv(spec: EngineSpec) -> list[str]:
    role_args = (prefill.role if spec.role == "prefill" else decode.role).vllm_args(
        spec.max_model_len
    )
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model,
        "--served-model-name", spec.served_model_name,
        "--host", spec.host,
        "--port", str(spec.port),
        "--dtype", spec.dtype,
        "--max-model-len", str(spec.max_model_len),
        "--enforce-eager",
        "--kv-transfer-config", kv_transfer_config_json(spec.role, spec.connector),
        "--uvicorn-log-level", "warning",
        "--disable-uvicorn-access-log",
        *role_args,
    ]
    if spec.device == "cuda":
        argv += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.kv_events_bind is not None:
        argv += ["--kv-events-config", kv_events_config(spec.kv_events_bind)]
    if spec.api_key is not None:  # the key itself goes by environment (engine_env), never argv
        argv += ["--middleware", f"{EngineGuard.__module__}.{EngineGuard.__name__}"]
    argv += list(spec.extra_args)
    if spec.netns is not None:
        argv = ["ip", "netns", "exec", spec.netns, *argv]
    return argv


def engine_env(spec: EngineSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(
        {
            "VLLM_NIXL_SIDE_CHANNEL_HOST": spec.host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(spec.side_channel_port),
            # Without these UCX may wait seconds on an unusable interface (STACK.md).
            "UCX_TLS": env.get("UCX_TLS", spec.ucx_tls or default_ucx_tls(spec.device)),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    if os.path.isdir(spec.model):  # a local model never needs the hub
        env.setdefault("HF_HUB_OFFLINE", "1")
    if spec.ucx_device is not None:
        # On a GPU, UCX may take RDMA: naming only the node's IP interface would shut it out.
        rdma = rdma_ports() if spec.device == "cuda" and env["UCX_TLS"] == UCX_TLS_GPU else []
        env["UCX_NET_DEVICES"] = ",".join([spec.ucx_device, *rdma])
    elif spec.loopback:
        env.setdefault("UCX_NET_DEVICES", "lo")
    if spec.dev_endpoints:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env.update(spec.extra_env)
    env.pop(KEY_ENV, None)  # a key of the launcher's own environment is not this engine's
    if spec.api_key is not None:
        env[KEY_ENV] = spec.api_key
    if spec.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(int(spec.kv_cache_gib))
        env["KMP_BLOCKTIME"] = "0"
        if spec.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_cores
    return env
