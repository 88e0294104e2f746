"""Time ``ngram_propose`` per call at 1K / 4K / 16K tokens of context (target: < 0.2 ms at 4K).

Three kinds of text: random ids over a 32K vocabulary (few matches), a small-vocabulary stream
(many candidate positions survive several extension rounds), and a repetitive one (copies of a
block, the case prompt lookup exists for). Input is a numpy buffer, as a proposer should keep it;
the list column adds the list -> array conversion a caller pays when it passes Python lists.

    python benchmarks/bench_ngram.py [--repeats N]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from specdec.proposers.ngram import ngram_propose


def contexts(length: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    block = rng.integers(0, 32000, size=200)
    return {
        "random-32k": rng.integers(0, 32000, size=length),
        "vocab-8": rng.integers(0, 8, size=length),
        "repetitive": np.resize(block, length),
    }


def per_call_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'context':>8} {'text':>12} {'numpy ms':>9} {'list ms':>8} drafts")
    for length in (1024, 4096, 16384):
        for name, seq in contexts(length, rng).items():
            seq = seq.astype(np.int64)
            as_list = seq.tolist()
            ms = per_call_ms(lambda: ngram_propose(seq, 5, 1, 5), args.repeats)
            ms_list = per_call_ms(lambda: ngram_propose(as_list, 5, 1, 5), max(1, args.repeats // 10))
            drafts = len(ngram_propose(seq, 5, 1, 5))
            print(f"{length:>8} {name:>12} {ms:>9.4f} {ms_list:>8.4f} {drafts}")


if __name__ == "__main__":
    main()
