"""Small corpus and tokenizer shared by the training tests (built once per session, offline)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from specdec.train.corpus import CorpusConfig, load_documents
from specdec.train.draft import DraftPreset, register_draft_preset
from specdec.train.presets import (
    TargetPreset,
    kimi_k2_config,
    llama_config,
    minimax_m3_config,
    register_preset,
)
from specdec.train.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer

# The stdlib's json package (a few files) plus the pydoc topics: real text, trained on in seconds.
SMALL_CORPUS = CorpusConfig(
    stdlib_dir=str(Path(sysconfig.get_paths()["stdlib"]) / "json"),
    include_topics=True,
    validation_fraction=0.1,
)
SMALL_VOCAB = 400

# Test-sized presets (seconds, not minutes), selectable by name like the zoo's.
for _name, _type, _config in (
    ("test-llama", "llama", llama_config(hidden=32, layers=2, heads=2, kv_heads=1, inter=64, tied=False)),
    ("test-kimi-k2", "deepseek_v3", kimi_k2_config(hidden=32, layers=2, heads=2, q_lora=16, kv_lora=16, nope=8,
                                                   rope=8, v_dim=8, dense_inter=64, expert_inter=16, experts=4,
                                                   top_k=2)),
    ("test-minimax-m3", "minimax_m3_vl_text", minimax_m3_config(hidden=32, layers=2, heads=2, kv_heads=1,
                                                               head_dim=16, rotary_dim=8, dense_inter=64,
                                                               expert_inter=16, experts=4, top_k=2, dense_layers=1,
                                                               topk_blocks=2)),
):
    register_preset(TargetPreset(name=_name, model_type=_type, config=_config, seq_len=32, batch_size=4, steps=30,
                                 quick_steps=10, lr=1e-2, warmup_steps=3, description="test-sized"))
for _name, _options in (
    ("test-eagle3", dict(attention="mha", draft_vocab_size=200, own_lm_head=True)),
    ("test-eagle3.1-mla", dict(attention="mla", eagle31=True, draft_vocab_size=300)),
    ("test-eagle3-unshifted", dict(attention="mha", unshifted=True, kv_sharing=True)),
):
    register_draft_preset(DraftPreset(name=_name, intermediate_size=64, aux_layer_ids=(0, 1), ttt_steps=3,
                                      seq_len=32, batch_size=4, steps=30, quick_steps=10, lr=5e-3, warmup_steps=3,
                                      description="test-sized", **_options))


@pytest.fixture(scope="session")
def small_corpus() -> CorpusConfig:
    return SMALL_CORPUS


@pytest.fixture(scope="session")
def small_tokenizer_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tokenizer")
    docs = load_documents("train", SMALL_CORPUS)
    save_tokenizer(train_tokenizer((d.text for d in docs), TokenizerConfig(vocab_size=SMALL_VOCAB)), folder)
    return folder
