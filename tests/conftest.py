"""Session-wide test set-up: one thread per op, and tiny random checkpoints built once per session.

Tiny models are dominated by per-op overhead; with two intra-op threads on a two-core machine
shared with other processes, small ops spend most of their time in thread hand-offs (measured:
repeat_interleave 2.4 ms vs 18 us). One thread keeps every test file fast. Without a GPU,
``TRITON_INTERPRET=1`` is set for the whole session (see below).

``tiny_checkpoint(arch)`` returns the folder of a float64 random checkpoint saved by transformers
(``save_pretrained``), built on first use and reused by every test of the session. ``"llama"``
also carries a word-level tokenizer, so text prompts work. Other test authors may use it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
import torch

torch.set_num_threads(1)

# Triton picks interpreter or compiler when a kernel is decorated (its module's first import), so the
# variable is set here, before any test module of any folder can import one. Without a GPU the
# interpreter is the only way the triton and aiter backends run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

VOCAB = 128
EOS = 2

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=EOS,
    # Wider than transformers' 0.02 so logits are spread and greedy tokens vary.
    initializer_range=0.2,
)


def tiny_config(arch: str):
    """The transformers config of the tiny ``arch`` checkpoint."""
    from transformers import DeepseekV3Config, LlamaConfig, MiniMaxM2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**_COMMON, intermediate_size=64, num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "llama_draft":
        # A smaller model with the same vocabulary, as a draft for "llama".
        return LlamaConfig(
            **{**_COMMON, "hidden_size": 16, "num_hidden_layers": 1},
            intermediate_size=32,
            num_key_value_heads=1,
        )
    if arch == "qwen3":
        return Qwen3Config(**_COMMON, intermediate_size=64, num_key_value_heads=2, head_dim=8)
    if arch == "deepseek_v3":
        return DeepseekV3Config(
            **_COMMON,
            intermediate_size=64,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
        )
    if arch == "minimax_m2":
        return MiniMaxM2Config(
            **_COMMON, intermediate_size=16, num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2
        )
    raise ValueError(f"no tiny config for {arch!r}")


def build_tiny_checkpoint(arch: str, folder: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = {}
    if arch in ("deepseek_v3", "minimax_m2"):
        kwargs["experts_implementation"] = "eager"  # the grouped-experts kernel has no float64
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float64, **kwargs)
    model.save_pretrained(folder)
    if arch == "llama":
        save_word_tokenizer(folder)
    return folder


def save_word_tokenizer(folder: Path) -> None:
    """A whitespace word-level tokenizer over ``VOCAB`` ids: <unk>=0, <s>=1, </s>=2, then words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["def", "import", "return", "the", "a", "of", "x", "y", "(", ")", ":", "=", "+", "print", "hello", "world"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in words + [f"w{i}" for i in range(VOCAB)]:
        if len(vocab) == VOCAB:
            break
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(folder)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """``tiny_checkpoint(arch) -> folder``; arches: llama (with tokenizer), llama_draft, qwen3,
    deepseek_v3, minimax_m2."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_checkpoint(arch, tmp_path_factory.mktemp(f"tiny_{arch}"))
        return built[arch]

    return get
