"""One torch-backend attention call over a ragged batch, against its parts apart and against one padded call.

    python benchmarks/bench_ragged.py [--verifies 16] [--queries 4] [--prompt-len 96] [--decodes 15]
        [--threads 1]

Two batches: verifies of ``--queries`` tokens beside a prompt (continuous batching admits prompts
among decoding requests), and ``--decodes`` decoding requests beside one verify (an adaptive
controller gives drafts to some requests only). Shapes are the zoo MiniMax-M3 target's (6 query
heads, 2 KV heads, head size 64, 128-token pages, bf16), contexts of about 150-260 tokens; with and
without a custom mask (block-sparse layers pass one). "one call" pads every request to the batch's
longest (what the backend did before backends/ragged.py); "grouped" is the backend as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import time

import attrs
import torch

from specdec.backends import ragged
from specdec.backends.base import AttentionMetadata
from specdec.backends.torch_ref import TorchBackend

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 128, 6, 2, 64


def metadata(query_lens: list[int], seq_lens: list[int], num_blocks: int, masked: bool) -> AttentionMetadata:
    tables = torch.arange(len(query_lens) * 3, dtype=torch.int32).view(len(query_lens), 3) % num_blocks
    meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens, block_tables=tables,
                                   slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64), block_size=BLOCK)
    if masked:
        meta = attrs.evolve(meta, custom_mask=torch.ones(sum(query_lens), meta.max_seq_len, dtype=torch.bool))
    return meta


def time_call(backend, caches, query_lens, seq_lens, masked, reps) -> float:
    """Mean ms of one attention call over this layout."""
    meta = metadata(query_lens, seq_lens, caches[0].shape[0], masked)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, dtype=torch.bfloat16)
    for _ in range(3):
        backend.attention(q, *caches, meta, scale=HEAD_DIM**-0.5)
    start = time.perf_counter()
    for _ in range(reps):
        backend.attention(q, *caches, meta, scale=HEAD_DIM**-0.5)
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifies", type=int, default=16)
    parser.add_argument("--queries", type=int, default=4, help="query tokens of each verifying request")
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--decodes", type=int, default=15, help="decoding requests beside one verify")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    caches = [torch.randn(64, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
    verifies = ([args.queries] * args.verifies, [150 + 7 * i for i in range(args.verifies)])
    prompt = ([args.prompt_len], [args.prompt_len])
    decodes = ([1] * args.decodes, [160 + 7 * i for i in range(args.decodes)])
    one_verify = ([args.queries], [155])
    backend = TorchBackend()
    for name, parts in ((f"{args.verifies} verifies + a prompt", (verifies, prompt)),
                        (f"{args.decodes} decodes + a verify", (decodes, one_verify))):
        mixed = (parts[0][0] + parts[1][0], parts[0][1] + parts[1][1])
        for masked in (False, True):
            apart = sum(time_call(backend, caches, *layout, masked, args.reps) for layout in parts)
            grouped = time_call(backend, caches, *mixed, masked, args.reps)
            with one_padded_call():
                whole = time_call(backend, caches, *mixed, masked, args.reps)
            print(f"{name}, custom mask {masked!s:5}: apart {apart:.3f} ms, one call {whole:.3f} ms "
                  f"({whole / apart:.2f}x), grouped {grouped:.3f} ms ({grouped / apart:.2f}x)")


@contextlib.contextmanager
def one_padded_call():
    """The backend without grouping: every batch padded whole."""
    slack = ragged.SLACK
    ragged.SLACK = math.inf
    try:
        yield
    finally:
        ragged.SLACK = slack


if __name__ == "__main__":
    main()
