"""Tests of launch.models: the tiny test model, the SmolLM2 conversion and the build cache."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from launch.models import DEFAULT_MODEL, build_tiny_model, ensure_model, is_complete, smollm2, tiny
from launch.models import cache as cache_mod
from launch.models.__main__ import main as models_main


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-a"))


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir)


# ----------------------------------------------------------------------------- tiny model


def test_tiny_build_is_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    messages: list[str] = []
    again = build_tiny_model(tmp_path / "tiny-b", progress=messages.append)
    assert again == tmp_path / "tiny-b"
    assert messages and all(m.startswith("tiny: ") for m in messages)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert sha256(tiny_dir / name) == sha256(again / name), name


def test_tiny_files_and_config(tiny_dir: Path) -> None:
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (tiny_dir / name).is_file(), name
    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 4
    assert config["hidden_size"] == 256
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 4096
    assert config["max_position_embeddings"] == 4096
    assert config["torch_dtype"] == "float32"
    assert config["eos_token_id"] == 2
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    assert tiny.KV_BYTES_PER_TOKEN_FP32 == 2 * 4 * 2 * 64 * 4 == 4096


def test_tiny_weights_are_float32_with_expected_shapes(tiny_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert {str(t.dtype) for t in tensors.values()} == {"torch.float32"}
    assert tuple(tensors["model.embed_tokens.weight"].shape) == (4096, 256)
    assert tuple(tensors["lm_head.weight"].shape) == (4096, 256)
    assert tuple(tensors["model.layers.0.self_attn.k_proj.weight"].shape) == (2 * 64, 256)
    assert tuple(tensors["model.layers.3.mlp.down_proj.weight"].shape) == (256, 512)
    assert len([k for k in tensors if k.endswith("q_proj.weight")]) == 4
    # special tokens can never win a greedy argmax
    assert float(tensors["lm_head.weight"][:3].abs().sum()) == 0.0


def test_tiny_tokenizer_round_trip(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    assert len(tok) == 4096
    assert tok.is_fast
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    for text in [
        "The prefill engine sends the KV cache to the decode engine.",
        'numbers 0 7 42 31415 and punctuation: (a), "b"; c!?',
        "  leading spaces,\ttabs\nand\n\nnewlines  ",
        "Ünïcödé, 日本語 and emoji 😀 are bytes too",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user")[0] == 1
    # the corpus vocabulary compresses: common words are single tokens
    assert len(tok.encode(" the")) == 1


def test_tiny_chat_template(tiny_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
    ]
    text = tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhello there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt.endswith("<|im_end|>\n")
    config = json.loads((Path(tiny_tokenizer.name_or_path) / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == tiny.CHAT_TEMPLATE


def test_synthetic_corpus_is_deterministic() -> None:
    a = list(tiny.synthetic_corpus(lines=50))
    assert a == list(tiny.synthetic_corpus(lines=50))
    assert a != list(tiny.synthetic_corpus(seed=tiny.SEED + 1, lines=50))


def test_tiny_greedy_generation_varies(tiny_dir: Path, tiny_tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    outputs = []
    for question in ("What is the capital of France?", "Tell me a story about a dragon."):
        ids = tiny_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            return_tensors="pt",
            return_dict=True,
        )["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=16,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        new = out.sequences[0, ids.shape[1] :].tolist()
        assert len(new) == 16  # never stops early: special tokens never win
        assert len(set(new)) > 8, new
        assert min(new) >= 3
        logits_std = float(out.scores[0][0].std())
        assert logits_std > 2.0  # far from the near-uniform logits of a default init
        outputs.append(new)
    assert outputs[0] != outputs[1]


# ----------------------------------------------------------------------------- smollm2 pieces


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """Verbatim logic of llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize(("n_head", "n_head_kv", "rows"), [(9, 9, 576), (9, 3, 192), (4, 2, 128)])
def test_unpermute_inverts_llama_cpp_permute(n_head: int, n_head_kv: int, rows: int) -> None:
    rng = np.random.default_rng(0)
    hf = rng.standard_normal((rows, 16)).astype(np.float32)
    gguf = llama_cpp_permute(hf, n_head, n_head_kv)
    assert not np.array_equal(gguf, hf)
    # llama.cpp permutes q with (n_head, n_head) and k with (n_head, n_head_kv): heads = n_head_kv
    assert np.array_equal(smollm2.unpermute_rotary(gguf, n_head_kv), hf)


def test_hf_tensor_names() -> None:
    assert smollm2.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert smollm2.hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert smollm2.hf_tensor_name("blk.0.attn_q.weight") == "model.layers.0.self_attn.q_proj.weight"
    assert (
        smollm2.hf_tensor_name("blk.29.attn_output.weight")
        == "model.layers.29.self_attn.o_proj.weight"
    )
    assert smollm2.hf_tensor_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    assert (
        smollm2.hf_tensor_name("blk.7.attn_norm.weight") == "model.layers.7.input_layernorm.weight"
    )
    assert (
        smollm2.hf_tensor_name("blk.7.ffn_norm.weight")
        == "model.layers.7.post_attention_layernorm.weight"
    )
    with pytest.raises(KeyError):
        smollm2.hf_tensor_name("blk.0.attn_q.bias")


def test_float32_metadata_rounding() -> None:
    assert smollm2._f32(9.999999747378752e-06) == 1e-05
    assert smollm2._f32(100000.0) == 100000.0


# ----------------------------------------------------------------------------- cache


@pytest.fixture()
def fake_builder(monkeypatch: pytest.MonkeyPatch):
    calls: list[Path] = []

    def build(out_dir: Path, *, progress=None) -> Path:
        calls.append(out_dir)
        time.sleep(0.2)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        if progress:
            progress("fake: built")
        return out_dir

    monkeypatch.setitem(cache_mod.KNOWN_MODELS, "tiny", build)
    monkeypatch.setitem(cache_mod.RECIPE_VERSIONS, "tiny", 1)
    return calls


def test_ensure_model_builds_once(tmp_path: Path, fake_builder: list[Path]) -> None:
    messages: list[str] = []
    first = ensure_model("tiny", tmp_path, progress=messages.append)
    assert first == tmp_path / "tiny"
    assert (first / "config.json").is_file() and is_complete(first, "tiny")
    assert "fake: built" in messages
    assert ensure_model("tiny", tmp_path) == first
    assert len(fake_builder) == 1
    assert (
        fake_builder[0].parent == tmp_path and fake_builder[0] != first
    )  # built next to it, then renamed
    assert not list(tmp_path.glob(".tiny.building-*"))
    assert first.stat().st_mode & 0o777 == 0o755


def test_ensure_model_default_root_from_env(
    tmp_path: Path, fake_builder, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "root"))
    assert ensure_model("tiny") == tmp_path / "root" / "tiny"
    monkeypatch.delenv("PDSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_mod.default_cache_root() == tmp_path / "home" / ".cache" / "pdserve" / "models"


def test_half_built_or_stale_dirs_are_rebuilt(
    tmp_path: Path, fake_builder, monkeypatch: pytest.MonkeyPatch
) -> None:
    half = tmp_path / "tiny"
    half.mkdir()
    (half / "model.safetensors").write_text("truncated")
    (tmp_path / ".tiny.building-leftover").mkdir()
    assert ensure_model("tiny", tmp_path) == half
    assert not (half / "model.safetensors").exists()
    assert not (tmp_path / ".tiny.building-leftover").exists()
    assert len(fake_builder) == 1
    monkeypatch.setitem(cache_mod.RECIPE_VERSIONS, "tiny", 2)  # recipe changed -> rebuild
    assert not is_complete(half, "tiny")
    ensure_model("tiny", tmp_path)
    assert len(fake_builder) == 2 and is_complete(half, "tiny")


def test_failed_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(out_dir: Path, *, progress=None) -> Path:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("boom")

    monkeypatch.setitem(cache_mod.KNOWN_MODELS, "tiny", broken)
    with pytest.raises(RuntimeError, match="boom"):
        ensure_model("tiny", tmp_path)
    assert not (tmp_path / "tiny").exists()
    assert not list(tmp_path.glob(".tiny.building-*"))


def test_concurrent_callers_build_once(tmp_path: Path, fake_builder: list[Path]) -> None:
    results: list[Path | str] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_model("tiny", tmp_path)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / "tiny"] * 3
    assert len(fake_builder) == 1


def test_directories_and_hub_ids_pass_through(tmp_path: Path) -> None:
    assert ensure_model(str(tmp_path)) == tmp_path
    assert (
        ensure_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    assert DEFAULT_MODEL == "smollm2"


def test_cli_prints_only_the_path(
    tmp_path: Path, fake_builder, capsys: pytest.CaptureFixture[str]
) -> None:
    assert models_main(["tiny", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{tmp_path / 'tiny'}\n"
    assert "fake: built" in captured.err


# ----------------------------------------------------------------------------- smollm2, end to end


@pytest.mark.slow
def test_smollm2_conversion_answers_paris(tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    messages: list[str] = []
    path = ensure_model("smollm2", tmp_path, progress=messages.append)
    assert path == tmp_path / "smollm2" and is_complete(path, "smollm2")
    assert any("layer 30/30" in m for m in messages)

    config = json.loads((path / "config.json").read_text())
    assert (
        config["num_hidden_layers"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (30, 9, 3)
    assert (config["head_dim"], config["hidden_size"], config["vocab_size"]) == (64, 576, 49152)
    assert config["tie_word_embeddings"] is True and config["torch_dtype"] == "float32"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "torch.float32"
    assert len(keys) == 2 + 30 * 9 and "lm_head.weight" not in keys

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    assert tok.encode("12345") == tok.convert_tokens_to_ids(
        list("12345")
    )  # digits split one by one
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_a_known_model_reads_the_same_path_on_nodes_with_different_homes(tmp_path):
    """NIXL's handshake hashes the model's path string: two nodes whose builds live under
    different homes must hand vLLM the same path, each resolving to its own build."""
    links = tmp_path / "links"  # each node's own /tmp/pdserve-<uid>/models in real life
    builds = []
    for home in ("head", "worker"):
        built = tmp_path / home / ".cache" / "tiny"
        built.mkdir(parents=True)
        (built / "config.json").write_text(home)
        builds.append(built)
    head = cache_mod.same_on_every_node("tiny", builds[0], links)
    assert (head / "config.json").read_text() == "head"
    worker = cache_mod.same_on_every_node("tiny", builds[1], links)  # replaced in place
    assert str(worker) == str(head) and (worker / "config.json").read_text() == "worker"
    # A path or a hub id given by the user is the same on every node already.
    assert cache_mod.same_on_every_node("/models/x", "/models/x", links) == "/models/x"
