"""Build a speculative engine from its parts, without the ``LLM`` facade.

    python examples/build_engine_from_parts.py [TARGET_DIR]

With no folder given, a tiny random Llama is written to a temporary folder first (offline).
Every part is an ordinary object you can swap: the model, the paged cache (one budget for the
target's and the proposer's pools), the attention backend, the scheduler, the sampler, the
proposer and the verifier.
"""

from __future__ import annotations

import sys
import tempfile

from specdec.backends import get_backend
from specdec.cache import PagedKVCache
from specdec.engine import LLMEngine, Scheduler, SchedulerConfig
from specdec.models import load_model
from specdec.proposers.ngram import NgramProposer
from specdec.sampling import Sampler, SamplingParams
from specdec.verifiers import GreedyVerifier


def tiny_llama(folder: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def main(target: str) -> None:
    engine = LLMEngine(
        load_model(target, dtype="float32"),
        PagedKVCache(memory_budget=16 << 20),  # the engine registers the pools and builds it
        get_backend("torch"),
        scheduler=Scheduler(SchedulerConfig(max_num_seqs=8)),
        sampler=Sampler(),
        proposer=NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3),
        verifier=GreedyVerifier(),
        block_size=16,
    )
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2], [7, 7, 7, 7], [40, 41, 42]]
    seqs = engine.generate(prompts, [SamplingParams(max_tokens=16, ignore_eos=True)] * len(prompts))
    for seq in seqs:
        print(seq.index, seq.finish_reason, seq.output_token_ids)
    print("spec_stats:", engine.spec_stats.as_dict())
    print("engine:", engine.stats)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(tiny_llama(tmp))
