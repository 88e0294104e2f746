"""Playing the engine around one proposer in unit tests: pools, admission, a target forward, feedback.

What ``LLMEngine`` does in a step, reduced to one request and plain calls, so a test can drive a
proposer through a chunked prefill the engine itself never schedules.
"""

from __future__ import annotations

from specdec.backends import get_backend
from specdec.cache import PagedKVCache
from specdec.engine.pools import register_pools
from specdec.proposers.base import StepFeedback
from specdec.runtime.layout import StepLayout
from specdec.runtime.model_runner import Chunk, ModelRunner


class OneRequestEngine:
    """The target's runner, the cache and the proposer's declared pools for ``proposer``."""

    def __init__(self, target, proposer, *, block_size: int, memory: int):
        self.target, self.proposer = target, proposer
        self.cache = PagedKVCache(memory)
        self.pools = register_pools(target, self.cache, get_backend("torch"), proposer, block_size=block_size,
                                    max_model_len=256)
        self.cache.build()
        self.runner = ModelRunner(target, self.cache, get_backend("torch"), self.pools.target)

    def forward(self, seq, tokens):
        """Run ``tokens`` of ``seq`` on the target (admitting it first if it holds nothing) and tell the
        proposer; returns the target output."""
        cache, request = self.cache, seq.seq_id
        if cache.num_tokens(request, "target") == 0 and self.pools.draft.prompt_free:
            cache.set_start(request, seq.num_prompt_tokens, self.pools.draft.prompt_free)
        start = cache.num_tokens(request, "target")
        out = self.runner.forward([Chunk(request, tokens)], self.proposer.aux_layer_ids)
        if start + len(tokens) == seq.num_prompt_tokens:
            last = out.hidden_states[-1:]
            seq.append(self.target.compute_logits(last).argmax(-1).tolist())
        layout = StepLayout.build([request], [start], [len(tokens)])
        self.proposer.on_step(StepFeedback(seqs=[seq], layout=layout, num_accepted=[0], target_output=out))
        return out
