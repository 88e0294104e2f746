from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from specdec.train.corpus import load_documents
from specdec.train.tokenizer import (
    BOS_ID,
    CHAT_TEMPLATE,
    EOS_ID,
    PAD_ID,
    TokenizerConfig,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

SAMPLES = [
    "def foo(x):\n    return x + 1\n",
    "\tTabs,  double  spaces and trailing   \n\n",
    "Unicode: café, naïve, 日本語, emoji 🐍, NUL-free control \x07 char",
    "",
]


def test_saved_tokenizer_loads_with_autotokenizer_and_round_trips(small_tokenizer_dir):
    config = json.loads((small_tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = AutoTokenizer.from_pretrained(str(small_tokenizer_dir), local_files_only=True)
    assert len(tok) == 400
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID)
    for text in SAMPLES:
        ids = tok(text)["input_ids"]
        assert ids[0] == BOS_ID  # a prompt looks like the start of a training document
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_the_chat_template_is_kept_in_the_config_through_a_resave(small_tokenizer_dir, tmp_path):
    """A saved tokenizer carries CHAT_TEMPLATE in tokenizer_config.json; saving a loaded one keeps it there."""
    save_tokenizer(load_tokenizer(small_tokenizer_dir), tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE and not (tmp_path / "chat_template.jinja").exists()


def test_bpe_merges_compress_code(small_tokenizer_dir):
    tok = load_tokenizer(small_tokenizer_dir)
    text = "import json\n\ndef decode(self, s):\n    return self.raw_decode(s)\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) < 0.75 * len(text.encode())  # 400 tokens leave only ~140 merges


def test_training_is_deterministic(small_corpus):
    texts = [d.text for d in load_documents("train", small_corpus)]
    a = train_tokenizer(texts, TokenizerConfig(vocab_size=300))
    b = train_tokenizer(texts, TokenizerConfig(vocab_size=300))
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()


def test_bad_vocab_size_and_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be at least"):
        TokenizerConfig(vocab_size=100)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
