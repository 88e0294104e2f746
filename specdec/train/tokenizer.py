"""A byte-level BPE tokenizer trained on the offline corpus, saved in the transformers layout.

Byte-level BPE covers every input (no unknown token) and decodes back to the exact text. The
special tokens sit at fixed ids (pad 0, bos 1, eos 2) so every zoo model agrees on them, and a
post-processor prepends ``<s>`` the way Llama's tokenizer does: training documents start with it
too, so a prompt encoded with ``add_special_tokens=True`` looks like the start of a document.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import attrs
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# 256 byte symbols + 3 specials is the smallest vocabulary byte-level BPE can have.
_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def _validated_vocab(instance, attribute, value) -> None:
    if value < _MIN_VOCAB + 1:
        raise ValueError(f"vocab_size must be at least {_MIN_VOCAB + 1} (bytes + specials + one merge), got {value}")


@attrs.frozen
class TokenizerConfig:
    """Settings of the BPE training."""

    vocab_size: int = attrs.field(default=4096, validator=_validated_vocab)
    min_frequency: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    model_max_length: int = attrs.field(default=4096, validator=attrs.validators.ge(1))


def _build_untrained() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: code starts lines with keywords, and decode must round-trip exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], config: TokenizerConfig | None = None) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it as a transformers tokenizer."""
    config = config or TokenizerConfig()
    tok = _build_untrained()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for token, expected in zip(SPECIAL_TOKENS, (PAD_ID, BOS_ID, EOS_ID)):
        actual = tok.token_to_id(token)
        if actual != expected:  # the trainer puts specials first; guard the ids every model relies on
            raise RuntimeError(f"special token {token!r} got id {actual}, expected {expected}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return wrap_tokenizer(tok, config.model_max_length)


def wrap_tokenizer(tok: Tokenizer, model_max_length: int = 4096) -> PreTrainedTokenizerFast:
    """A ``tokenizers.Tokenizer`` as a transformers fast tokenizer with the zoo's special tokens."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


# A plain role-prefixed transcript: the zoo's models are trained on source text, not dialogue, so any
# template is as good as another; this one lets /v1/chat/completions and lm_eval's chat mode run.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: str | Path) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (with :data:`CHAT_TEMPLATE` unless the tokenizer
    has its own) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    # transformers 5 records its internal class name "TokenizersBackend", which transformers 4.x
    # (and tools pinned to it) cannot resolve; the generic fast class loads in both.
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    # transformers 5 writes a tokenizer's template to chat_template.jinja; keep it in the config, where
    # every version (and the zoo's manifest) expects it.
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        config["chat_template"] = jinja.read_text()
        jinja.unlink()
    config.setdefault("chat_template", CHAT_TEMPLATE)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerFast:
    """Load a saved tokenizer offline, checking that it carries the zoo's special-token ids."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{str(folder)!r} has no tokenizer.json; train one with `python -m specdec.train tokenizer --out DIR`"
        )
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if (tokenizer.bos_token_id, tokenizer.eos_token_id) != (BOS_ID, EOS_ID):
        raise ValueError(
            f"tokenizer in {str(folder)!r} has bos/eos ids {tokenizer.bos_token_id}/{tokenizer.eos_token_id}, "
            f"expected {BOS_ID}/{EOS_ID}; retrain it with specdec.train.tokenizer"
        )
    return tokenizer
