"""One torch-backend attention call over a batch mixing verifies with a prompt, against the two apart.

    python benchmarks/bench_ragged.py [--verifies 16] [--queries 4] [--prompt-len 96] [--threads 1]

Shapes are the zoo MiniMax-M3 target's (6 query heads, 2 KV heads, head size 64, 128-token pages,
bf16), contexts of about 150-260 tokens for the verifying requests; with and without a custom mask
(block-sparse layers pass one). Before backends/ragged.py the mixed call padded every request to the
prompt's length; the ratio mixed / (verifies + prompt) shows what grouping leaves of that.
"""

from __future__ import annotations

import argparse
import time

import attrs
import torch

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
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    caches = [torch.randn(64, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
    verifies = ([args.queries] * args.verifies, [150 + 7 * i for i in range(args.verifies)])
    prompt = ([args.prompt_len], [args.prompt_len])
    mixed = (verifies[0] + prompt[0], verifies[1] + prompt[1])
    backend = TorchBackend()
    for masked in (False, True):
        apart, alone, together = (time_call(backend, caches, *layout, masked, args.reps)
                                  for layout in (verifies, prompt, mixed))
        print(f"custom mask {masked!s:5}: verifies {apart:.3f} ms, prompt {alone:.3f} ms, "
              f"mixed {together:.3f} ms ({together / (apart + alone):.2f}x of the two apart)")


if __name__ == "__main__":
    main()
