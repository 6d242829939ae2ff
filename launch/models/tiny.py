"""A deterministic tiny Llama chat model for tests, built locally with no downloads.

Contract:
- ``build_tiny_model(out_dir)`` writes a complete Hugging Face model directory
  (``config.json``, ``generation_config.json``, ``model.safetensors`` in float32,
  ``tokenizer.json``/``tokenizer_config.json`` with a ChatML chat template) that
  transformers and vLLM load as-is, and returns ``out_dir``.
- Everything is generated in code: the tokenizer is a byte-level BPE trained on a
  synthetic corpus made from an embedded word list with ``random.Random(SEED)``,
  and the weights come from a seeded ``torch.Generator``. Two builds, on any
  machine, give byte-identical ``model.safetensors`` and ``tokenizer.json``.
- The weights are random but deliberately large (see ``_INIT_STD``) so greedy
  decoding has clear argmax margins (several logits units, far above fp32
  noise) and outputs depend on the prompt; a P/D run and a single-engine run
  therefore pick the same greedy tokens.
- The lm_head rows of the special tokens are zero, so greedy decoding never
  emits ``<|im_end|>`` (or any special token) by chance: greedy generations
  always run to ``max_tokens``. ``<|im_end|>`` is still the eos token.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

SEED = 1234
VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 4096
NUM_LAYERS = 4
HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS

#: bytes of KV cache per token in float32: 2 (K and V) x layers x KV heads x head size x 4
KV_BYTES_PER_TOKEN_FP32 = 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Standard deviations of the seeded normal init, by parameter-name suffix. Much larger
# than the usual 0.02: with hidden 256 an lm_head std of 0.25 gives logits with std ~4
# (median top-1/top-2 gap ~0.75). q/k stay small (attention-score std ~1): sharper
# attention made fp32 noise grow ~400x over a 3000-token prompt (measured against fp64:
# max logit error ~2.5e-5 with these values, ~1e-2 with q/k at 0.25).
_INIT_STD: dict[str, float] = {
    "embed_tokens.weight": 1.0,
    "q_proj.weight": 0.06,
    "k_proj.weight": 0.06,
    "v_proj.weight": 0.15,
    "o_proj.weight": 0.1,
    "gate_proj.weight": 0.12,
    "up_proj.weight": 0.12,
    "down_proj.weight": 0.08,
    "lm_head.weight": 0.25,
}

_WORDS_TEXT = """
the of and to in is was for on that with as by at from it an be this are or his
which had not but were they have all one their has been her more when who would
there can its also first she two into new other time after some only up out so
about year years them than over most may these between during city world many
people then no school state later made such him part known where under since
both family three however used well while each war including life called high
name day through being before any same small music work used number house light
water river sea mountain forest road bridge garden market train station window
door table chair book letter paper story song voice morning evening night summer
winter spring autumn rain snow wind cloud sun moon star stone gold silver iron
glass bread cheese apple orange lemon coffee tea milk sugar salt pepper red green
blue yellow black white bright dark quick slow quiet loud warm cold old young
good great little long short large open close begin end start stop walk run
read write speak listen think know want need give take make find keep hold
bring carry build break learn teach help ask answer question reason idea plan
system model token engine server request cache memory layer network signal
value table index order queue batch prefill decode stream message user assistant
hello please thank yes maybe never always often sometimes today tomorrow here
"""
_WORDS = _WORDS_TEXT.split()

_SYLLABLES_TEXT = """
ka lo mi ra te su vin dor pel qua zen tor bri sha nu fe gal hem ix ju
kor lam mest nor os pra rin sol tam ul vex wo yen zar ben cra dul eph
"""
_SYLLABLES = _SYLLABLES_TEXT.split()

_PUNCTUATION = [".", ".", ".", ",", ",", "!", "?", ";", ":"]


def _pseudo_word(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))


def _sentence(rng: random.Random, lexicon: list[str], weights: list[float]) -> str:
    words: list[str] = []
    for _ in range(rng.randint(4, 18)):
        roll = rng.random()
        if roll < 0.72:
            words.append(rng.choices(lexicon, weights)[0])
        elif roll < 0.90:
            words.append(_pseudo_word(rng))
        elif roll < 0.96:
            words.append(str(rng.randint(0, 10 ** rng.randint(1, 5))))
        else:
            words.append(
                rng.choice(["(", '"', "'"]) + rng.choice(lexicon) + rng.choice([")", '"', "'"])
            )
    if rng.random() < 0.3:
        words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(_PUNCTUATION)


def synthetic_corpus(seed: int = SEED, lines: int = 6000) -> Iterator[str]:
    """Deterministic synthetic text: sentences, numbers and ChatML-formatted turns."""
    rng = random.Random(seed)
    lexicon = _WORDS + [w.capitalize() for w in _WORDS[:60]]
    weights = [1.0 / (1 + i) ** 0.6 for i in range(len(lexicon))]
    for _ in range(lines):
        text = " ".join(_sentence(rng, lexicon, weights) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.15:
            role = rng.choice(["system", "user", "assistant"])
            text = f"{IM_START}{role}\n{text}{IM_END}\n"
        elif rng.random() < 0.1:
            text = "    " + text.replace(", ", ",\n    ")
        yield text


def _report(progress: Progress | None, message: str) -> None:
    logger.info(message)
    if progress is not None:
        progress(message)


def build_tokenizer(seed: int = SEED):
    """Train the byte-level BPE and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(synthetic_corpus(seed), trainer=trainer)
    size = tok.get_vocab_size()
    if size != VOCAB_SIZE:
        raise RuntimeError(f"tiny tokenizer trained to {size} tokens, expected {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=IM_START,
        eos_token=IM_END,
        unk_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )


def tiny_config():
    """The ``LlamaConfig`` of the tiny model."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        bos_token_id=SPECIAL_TOKENS.index(IM_START),
        eos_token_id=SPECIAL_TOKENS.index(IM_END),
        pad_token_id=SPECIAL_TOKENS.index(ENDOFTEXT),
        initializer_range=0.25,
        architectures=["LlamaForCausalLM"],
        torch_dtype="float32",
    )


def _seeded_init(model, seed: int) -> None:
    """Overwrite every parameter from one seeded generator, in sorted-name order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = next((s for suffix, s in _INIT_STD.items() if name.endswith(suffix)), None)
            if std is None:
                raise RuntimeError(f"no init rule for parameter {name}")
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
        # Special tokens never win a greedy argmax (their logit is exactly 0).
        model.lm_head.weight[: len(SPECIAL_TOKENS)].zero_()


def build_tiny_model(out_dir: Path, *, progress: Progress | None = None) -> Path:
    """Build the tiny model into ``out_dir`` (created if needed) and return it."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    _report(progress, f"tiny: training byte-level BPE tokenizer (vocab {VOCAB_SIZE})")
    tokenizer = build_tokenizer()

    _report(
        progress,
        f"tiny: initialising Llama ({NUM_LAYERS} layers, hidden {HIDDEN_SIZE}, seed {SEED})",
    )
    config = tiny_config()
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
        _seeded_init(model, SEED)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )

    _report(progress, f"tiny: saving to {out_dir}")
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    pin_config_dtype(out_dir / "config.json")
    _report(progress, "tiny: done")
    return out_dir


def save_tokenizer(tokenizer, out_dir: Path) -> None:
    """Save with the chat template inside tokenizer_config.json and a portable class name.

    transformers 5 would write ``chat_template.jinja`` and the class name
    ``TokenizersBackend``; older readers (and vLLM on transformers 4) know only
    ``PreTrainedTokenizerFast`` and the template in the config, which 5 reads too.
    """
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    if "chat_template" not in config:
        raise RuntimeError("tokenizer_config.json was saved without its chat_template")
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def pin_config_dtype(config_path: Path) -> None:
    """Name float32 in config.json under both keys: ``torch_dtype`` (transformers 4) and
    ``dtype`` (5)."""
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = "float32"
    if "dtype" in config:
        config["dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
