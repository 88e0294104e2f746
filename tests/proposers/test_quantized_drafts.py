"""The speculative config's ``quantization`` key: a draft with weight-only quantized layers drafts
differently, never changes the output (float64, greedy, token for token the plain engine's), leaves
the weights it shares with the target alone, and in float32 runs torch's packed kernels at small
batches while keeping most of its acceptance."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.models.quantization import SCHEMES, PackedWeight
from specdec.zoo import zoo_path

PROMPTS = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [5] * 9, [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [100]]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)
TEXTS = [
    "def read_config(path):\n    \"\"\"Return the settings stored in the file at path.\"\"\"\n    with open(path) as f:\n",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n",
]


def _eagle3(k: int = 3, **keys) -> dict:
    return {"method": "eagle3", "model": str(zoo_path("llama-tiny-eagle3")), "num_speculative_tokens": k, **keys}


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_quantized_self_draft_is_lossless(scheme, llama):
    """The target drafting for itself accepts everything; quantized, it drafts other tokens, and the
    output is the plain engine's all the same."""
    common = dict(dtype="float64", block_size=4, kv_cache_memory=1 << 22)
    plain = LLM(llama, **common).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(llama, speculative_config={"method": "draft_model", "model": llama, "num_speculative_tokens": 3,
                                          "quantization": scheme}, **common)
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    stats = llm.spec_stats()
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens


def test_a_quantized_eagle3_draft_is_lossless():
    target = str(zoo_path("llama-tiny"))
    common = dict(dtype="float64", kv_cache_memory=1 << 24)
    plain = LLM(target, **common).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(target, speculative_config=_eagle3(quantization="int4"), **common)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == [o.token_ids for o in plain]


def test_the_target_keeps_the_rows_the_draft_reads():
    """The zoo llama-tiny draft reads the target's head, which is the target's (tied) embedding: the
    draft quantizes a copy."""
    target = str(zoo_path("llama-tiny"))
    plain = LLM(target, dtype="float32", kv_cache_memory=1 << 24).engine.model
    engine = LLM(target, speculative_config=_eagle3(quantization="int4"), dtype="float32", kv_cache_memory=1 << 24).engine
    assert torch.equal(engine.model.output_weight(), plain.output_weight())
    draft = engine.proposer.draft
    assert draft.output_weight().data_ptr() == engine.model.output_weight().data_ptr()  # shared, as unquantized
    assert not torch.equal(draft.logits_weight(), draft.output_weight())


def test_small_batches_take_the_kernels_and_keep_acceptance(monkeypatch):
    """float32, the zoo llama-tiny pair, one request at a time: every draft step runs through the packed
    kernels, and each scheme keeps most of the unquantized draft's acceptance (measured: int8 the same,
    int4 within 2%)."""
    target = str(zoo_path("llama-tiny"))
    calls = []
    kernel = PackedWeight.__call__
    monkeypatch.setattr(PackedWeight, "__call__", lambda self, x: calls.append(x.shape[0]) or kernel(self, x))
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    accepted = {}
    for scheme in (None, *SCHEMES):
        llm = LLM(target, speculative_config=_eagle3(quantization=scheme), dtype="float32", kv_cache_memory=1 << 24)
        calls.clear()
        for prompt in TEXTS:
            llm.generate([prompt], params, use_tqdm=False)
        stats = llm.spec_stats()
        accepted[scheme] = stats.num_accepted_tokens / stats.num_draft_tokens
        assert bool(calls) == (scheme is not None)
    assert accepted[None] > 0.5
    assert accepted["int8"] >= 0.95 * accepted[None] and accepted["int4"] >= 0.85 * accepted[None]
