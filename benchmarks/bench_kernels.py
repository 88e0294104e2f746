"""Time the triton and aiter-Triton attention kernels on a GPU against its copy bandwidth.

    python benchmarks/bench_kernels.py            # on a GPU: decode and verify shapes, MHA/GQA and MLA
    python benchmarks/bench_kernels.py --smoke    # a tiny correctness run (on a CPU: under the interpreter)
    python benchmarks/bench_kernels.py --json     # one JSON object instead of the table

Attention at these shapes is bound by reading the KV cache, so each kernel's figure is the bytes it
must move (the keys and values of every visible token, plus queries and outputs) over its time, set
against the bandwidth of a large device-to-device copy measured in the same run. A timing is the
whole backend call, host-side preparation included (the aiter MLA path builds per-token indices).
Without a GPU it says so and exits 0, unless ``--smoke`` asks for the interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny correctness run (CPU: under TRITON_INTERPRET=1; GPU: compiled)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--backends", default="triton,aiter", help="comma-separated backends to time")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=50, help="timed iterations per kernel")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        if not args.smoke:
            print("bench_kernels: needs a GPU (CUDA or ROCm); nothing timed. --smoke runs a tiny CPU interpreter check.")
            return 0
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return _run(args)


# ----------------------------------------------------------------------------- shapes


def _shapes(smoke: bool):
    """(name, kind, batch, query_len, seq_len, heads, kv_heads, head_dim, page, mla_rank)."""
    if smoke:
        return [
            ("gqa decode", "attention", 2, 1, 40, 4, 2, 32, 16, None),
            ("gqa verify k=3", "attention", 2, 4, 40, 4, 2, 32, 16, None),
            ("mla decode", "mla", 2, 1, 40, 16, 1, 48, 16, 32),
            ("mla verify k=3", "mla", 2, 4, 40, 16, 1, 48, 16, 32),
        ]
    shapes = []
    for batch, seq in ((8, 4096), (64, 2048), (128, 8192)):
        shapes.append((f"gqa 32/8 d128 decode b{batch} s{seq}", "attention", batch, 1, seq, 32, 8, 128, 16, None))
        shapes.append((f"gqa 32/8 d128 verify k=3 b{batch} s{seq}", "attention", batch, 4, seq, 32, 8, 128, 16, None))
    for batch, seq, heads in ((8, 4096, 16), (64, 4096, 128), (32, 8192, 16)):
        shapes.append((f"mla h{heads} 512+64 decode b{batch} s{seq}", "mla", batch, 1, seq, heads, 1, 576, 64, 512))
        shapes.append((f"mla h{heads} 512+64 verify k=3 b{batch} s{seq}", "mla", batch, 4, seq, heads, 1, 576, 64, 512))
    return shapes


def _build(shape, dtype, device):
    import torch

    from specdec.backends.base import AttentionMetadata

    _, kind, batch, query_len, seq_len, heads, kv_heads, head_dim, page, rank = shape
    blocks_per_seq = -(-seq_len // page)
    num_blocks = batch * blocks_per_seq + 1
    g = torch.Generator(device="cpu").manual_seed(0)
    order = torch.randperm(num_blocks - 1, generator=g) + 1  # shuffled pages, as a long-running server has
    table = order[: batch * blocks_per_seq].view(batch, blocks_per_seq).to(torch.int32)
    positions = torch.arange(seq_len - query_len, seq_len)
    slots = (table[:, positions // page].long() * page + positions % page).reshape(-1)
    meta = AttentionMetadata.build(
        query_lens=[query_len] * batch,
        seq_lens=[seq_len] * batch,
        block_tables=table.to(device),
        slot_mapping=slots.to(device),
        block_size=page,
    )
    q = torch.randn(batch * query_len, heads, head_dim, device=device).to(dtype)
    if kind == "mla":
        latent = torch.randn(num_blocks, page, head_dim, device=device).to(dtype)
        kv_bytes = batch * seq_len * head_dim * latent.element_size()
        out_dim = rank
        caches = (latent,)
    else:
        k = torch.randn(num_blocks, page, kv_heads, head_dim, device=device).to(dtype)
        v = torch.randn(num_blocks, page, kv_heads, head_dim, device=device).to(dtype)
        kv_bytes = 2 * batch * seq_len * kv_heads * head_dim * k.element_size()
        out_dim = head_dim
        caches = (k, v)
    moved = kv_bytes + q.numel() * q.element_size() + batch * query_len * heads * out_dim * q.element_size()
    return meta, q, caches, moved


def _call(backend, shape, meta, q, caches):
    kind, rank = shape[1], shape[9]
    scale = shape[7] ** -0.5
    if kind == "mla":
        return backend.mla_attention(q, caches[0], meta, kv_lora_rank=rank, scale=scale)
    return backend.attention(q, caches[0], caches[1], meta, scale=scale)


# ----------------------------------------------------------------------------- timing


def _time_gpu(fn, iters: int) -> float:
    """Median seconds of ``fn`` over ``iters`` runs, timed with device events after a warm-up."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def _copy_bandwidth(iters: int) -> float:
    """Bytes per second of a 1 GiB device copy (read + write counted)."""
    import torch

    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    seconds = _time_gpu(lambda: dst.copy_(src), max(iters // 5, 5))
    return 2 * src.numel() * src.element_size() / seconds


def _run(args) -> int:
    import torch

    from specdec.backends import get_backend
    from specdec.backends.torch_ref import TorchBackend

    # --smoke on a GPU is the same tiny correctness run, compiled instead of interpreted.
    smoke = args.smoke or not torch.cuda.is_available()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if smoke else getattr(torch, args.dtype)
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)", "dtype": str(dtype)}
    if device == "cuda":
        report["copy_GBps"] = _copy_bandwidth(args.iters) / 1e9
    backends = {}
    for name in args.backends.split(","):
        try:
            backends[name] = get_backend(name)
        except Exception as exc:  # report and keep timing the others
            report.setdefault("unavailable", {})[name] = str(exc).splitlines()[0]
    reference = TorchBackend()
    rows = []
    for shape in _shapes(smoke):
        meta, q, caches, moved = _build(shape, dtype, device)
        expected = _call(reference, shape, meta, q.double(), tuple(c.double() for c in caches)) if smoke else None
        for name, backend in backends.items():
            row = {"shape": shape[0], "backend": name, "MB": moved / 1e6}
            try:
                if smoke:
                    start = time.perf_counter()
                    out = _call(backend, shape, meta, q, caches)
                    if device == "cuda":
                        torch.cuda.synchronize()  # kernels launch asynchronously
                    row["seconds"] = time.perf_counter() - start
                    row["max_abs_err"] = float((out.double() - expected).abs().max())
                else:
                    row["seconds"] = _time_gpu(lambda: _call(backend, shape, meta, q, caches), args.iters)
                    row["GBps"] = moved / row["seconds"] / 1e9
                    row["of_copy"] = row["GBps"] / report["copy_GBps"]
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            rows.append(row)
        del caches
    report["rows"] = rows
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(report, smoke)
    return 0


def _print_table(report, smoke: bool) -> None:
    print(f"device: {report['device']}  dtype: {report['dtype']}")
    if "copy_GBps" in report:
        print(f"device copy bandwidth: {report['copy_GBps']:.0f} GB/s")
    for name, why in report.get("unavailable", {}).items():
        print(f"{name}: unavailable ({why})")
    for row in report["rows"]:
        head = f"{row['shape']:<40} {row['backend']:<7}"
        if "error" in row:
            print(f"{head} error: {row['error']}")
        elif smoke:
            how = "interpreter" if report["device"].startswith("cpu") else "first call, compile included"
            print(f"{head} {row['seconds'] * 1e3:9.1f} ms ({how})  max |err| vs float64 torch {row['max_abs_err']:.2e}")
        else:
            print(
                f"{head} {row['seconds'] * 1e6:9.1f} us  {row['MB']:8.1f} MB  {row['GBps']:7.0f} GB/s"
                f"  {100 * row['of_copy']:5.1f}% of copy"
            )


if __name__ == "__main__":
    sys.exit(main())
