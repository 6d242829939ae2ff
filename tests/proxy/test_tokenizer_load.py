"""The proxy loads a model's tokenizer without transformers' model machinery (and torch) when
the tokenizer is the generic fast one, and gets the tokenizer ``AutoTokenizer`` would have:
the same ids for prompts and chats. Other tokenizers still go through ``AutoTokenizer``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.tokens import PromptTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital?"},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}],
]
PROMPTS = ["hello world", "The quick brown fox " * 40, "<|im_start|>user\nhi"]


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model_dir(request) -> str:
    from launch.models import ensure_model

    return str(ensure_model(request.param))


def test_the_generic_fast_tokenizer_is_the_one_autotokenizer_builds(model_dir):
    from transformers import AutoTokenizer

    auto, ours = AutoTokenizer.from_pretrained(model_dir), load_tokenizer(model_dir)
    assert type(ours) is type(auto)
    for chat in CHATS:
        for generation in (True, False):
            assert (ours.apply_chat_template(chat, add_generation_prompt=generation)
                    == auto.apply_chat_template(chat, add_generation_prompt=generation))
    for prompt in PROMPTS:
        assert ours.encode(prompt) == auto.encode(prompt)
    assert ours.all_special_ids == auto.all_special_ids


def test_loading_it_does_not_import_torch(model_dir):
    """What the shortcut is for: 4-5 s of every proxy (and tokenizer worker) start here."""
    probe = (f"import sys; from proxy.tokens import PromptTokenizer; "
             f"t = PromptTokenizer({model_dir!r}); "
             "assert t.ids({'prompt': 'hi'}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_a_named_tokenizer_class_goes_through_autotokenizer(model_dir, tmp_path, monkeypatch):
    """A model that names its own class may change how it tokenizes: not the shortcut."""
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(
        json.dumps(dict(config, tokenizer_class="GPT2Tokenizer")))
    import transformers

    built: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained

    def auto(path, *args, **kwargs):
        built.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", auto)
    PromptTokenizer(str(copy))
    assert built == [str(copy)]
