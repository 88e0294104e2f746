"""An out-of-tree proposer, selected by a config string like a built-in method.

    python examples/custom_proposer.py

``BigramProposer`` drafts by following, from the request's last token, the successor seen most often
in the request's own tokens (a per-request bigram table). Its keyword parameters are its config keys
(``num_speculative_tokens``, ``min_count``), validated like a built-in's. A package ships such a
proposer with an entry point instead of ``register_proposer``::

    [project.entry-points."specdec.proposers"]
    bigram = "custom_proposer:BigramProposer"
"""

from __future__ import annotations

from collections import Counter, defaultdict

from specdec.proposers import Proposal, ProposerBase, register_proposer


class BigramProposer(ProposerBase):
    """Follows the most frequent successor of each token, seen ``min_count`` times or more."""

    def __init__(self, num_speculative_tokens: int, min_count: int = 1):
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_count = min_count

    def propose(self, seqs, max_drafts) -> Proposal:
        drafts = []
        for seq, limit in zip(seqs, max_drafts):
            successors: dict[int, Counter] = defaultdict(Counter)
            for a, b in zip(seq.token_ids, seq.token_ids[1:]):
                successors[a][b] += 1
            draft, token = [], seq.token_ids[-1]
            while len(draft) < limit and successors[token]:
                token, count = successors[token].most_common(1)[0]
                if count < self.min_count:
                    break
                draft.append(token)
            drafts.append(draft)
        return Proposal(drafts)


def main() -> None:
    from specdec import LLM, SamplingParams
    from specdec.zoo import zoo_path

    register_proposer("bigram", BigramProposer)
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n"]
    params = SamplingParams(max_tokens=48)
    target, memory = str(zoo_path("llama-tiny")), 64 << 20
    plain = LLM(target, kv_cache_memory=memory).generate(prompts, params, use_tqdm=False)
    llm = LLM(target, kv_cache_memory=memory, speculative_config="bigram:num_speculative_tokens=3,min_count=2")
    for out, ref in zip(llm.generate(prompts, params, use_tqdm=False), plain):
        print(repr(out.text), "(same as without speculation)" if out.token_ids == ref.token_ids else "(differs)")
    print("spec_stats:", llm.spec_stats().as_dict())


if __name__ == "__main__":
    main()
