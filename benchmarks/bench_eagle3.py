"""EAGLE3 at batch 1 and up: draft cost, verify cost, speedup, and how close it comes to the ideal.

    python benchmarks/bench_eagle3.py [--target DIR --draft DIR | --random] [--k 1,3,5] [--batch 1,4]

The pair is, in order: the folders given; the zoo's ``minimax-m3-tiny`` with its EAGLE3 draft when
built; else (or with ``--random``) a random Llama (hidden 512, 8 layers, vocab 4096, as in
bench_spec.py) with a random EAGLE3 head (SGLang layout). Prompts are windows of the offline
validation corpus (synthetic ids when the target has no tokenizer). For each k and batch size the
same prompts run without and with speculation, groups of ``batch`` at a time, the two engines taking
turns group by group so that both meet the same load on a shared machine; ``--repeats`` such runs
give one speedup each and the median run is printed (every run's in the note). Per-call medians are
taken inside the engine. Printed per row:

- ``decode ms``: a plain 1-token target step; ``verify ms``: the target's (k + 1)-token verify
  forward; ``verify/decode``: their ratio, which is about 1 on a GPU (both read the same weights);
- ``chain ms``: the whole proposer call per step (catch-up over the verified tokens + k drafts);
- ``c``: one draft forward over a plain target decode step (FACTS.md section 2);
- ``tau``: mean acceptance length and ``alpha`` the i.i.d. acceptance that gives it;
- ``speedup``: spec tok/s over plain tok/s, measured in the same run; ``ideal``: tau / (k c + 1);
  ``of ideal``: the measured share of it. A note per row gives acceptance per position and the
  bound once the verify cost is counted, tau / (k c + verify/decode).

Random weights accept almost nothing, so that pair shows cost structure only.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench_decode import small_llama  # the script's folder is on sys.path

from specdec.train.corpus import validation_prompts


def random_eagle3_draft(folder: str, target: str, draft_vocab: int, seed: int = 0) -> str:
    """An EAGLE3 head (SGLang layout) sized for ``target``, random weights, float32."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(target) / "config.json").read_text())
    H, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, inter = H // heads, 3 * H
    gen = torch.Generator().manual_seed(seed)

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen) / in_f**0.5

    aux = (2, layers // 2, layers - 3)
    p = "midlayer."
    w = {
        "fc.weight": lin(H, len(aux) * H),
        p + "self_attn.q_proj.weight": lin(heads * head_dim, 2 * H),
        p + "self_attn.k_proj.weight": lin(kv_heads * head_dim, 2 * H),
        p + "self_attn.v_proj.weight": lin(kv_heads * head_dim, 2 * H),
        p + "self_attn.o_proj.weight": lin(H, heads * head_dim),
        p + "mlp.gate_proj.weight": lin(inter, H),
        p + "mlp.up_proj.weight": lin(inter, H),
        p + "mlp.down_proj.weight": lin(H, inter),
        "norm.weight": torch.ones(H),
        "lm_head.weight": lin(draft_vocab, H),
    }
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[p + f"{name}.weight"] = torch.ones(H)
    ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    w["d2t"] = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1, "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6), "hidden_act": "silu",
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "max_position_embeddings": 4096,
        "rope_theta": cfg.get("rope_theta", 10000.0), "tie_word_embeddings": False, "target_hidden_size": H,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True},
    }
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in w.items()}, str(Path(folder) / "model.safetensors"))
    return folder


class Timer:
    """Wraps a bound method and keeps each call's wall time."""

    def __init__(self, obj, name: str):
        self.times: list[float] = []
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.times.append(time.perf_counter() - start)

        setattr(obj, name, timed)

    def steady_ms(self, skip: int) -> float:
        """Median of the calls after the first ``skip`` (prefills), in ms."""
        rest = sorted(self.times[skip:]) or [float("nan")]
        return 1e3 * rest[len(rest) // 2]


def alpha_from_tau(tau: float, k: int) -> float:
    """The i.i.d. per-draft acceptance alpha whose expected tokens per step (1 - a^(k+1)) / (1 - a) is tau."""
    lo, hi = 0.0, 1.0
    for _ in range(60):  # bisection: the expectation rises with alpha from 1 to k + 1
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(k + 1)) < tau else (lo, mid)
    return (lo + hi) / 2


def measure(target: str, draft: str, k: int, batch: int, max_tokens: int, prompts: list[list[int]],
            dtype: str, repeats: int) -> dict:
    from specdec import LLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    memory = 256 << 20
    # One request at a time for batch 1, as a user at batch 1 sees it; batches of ``batch`` otherwise.
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]

    plain = LLM(target, dtype=dtype, kv_cache_memory=memory, max_num_seqs=batch)
    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    llm = LLM(target, dtype=dtype, kv_cache_memory=memory, max_num_seqs=batch, speculative_config=spec)
    forward = Timer(plain.engine.runner, "run")
    proposer = llm.engine.proposer
    propose = Timer(proposer, "propose")
    draft_forward = Timer(proposer, "_forward")
    target_forward = Timer(llm.engine.runner, "run")
    for engine in (plain, llm):
        engine.generate(prompts[:1], warm, use_tqdm=False)
    llm.reset_spec_stats()
    for timer in (forward, propose, draft_forward, target_forward):  # keep only the measured generations
        timer.times.clear()

    # The two engines take turns group by group, so both see the same (shared, noisy) machine; each
    # repeat gives one speedup, and the median one is reported.
    speedups, plain_tps, spec_tps = [], [], []
    for _ in range(repeats):
        elapsed, tokens = {"plain": 0.0, "spec": 0.0}, {"plain": 0, "spec": 0}
        plain_outputs, outputs = [], []
        for group in groups:
            for name, engine, sink in (("plain", plain, plain_outputs), ("spec", llm, outputs)):
                start = time.perf_counter()
                out = engine.generate(group, params, use_tqdm=False)
                elapsed[name] += time.perf_counter() - start
                tokens[name] += sum(len(o.token_ids) for o in out)
                sink += out
        plain_tps.append(tokens["plain"] / elapsed["plain"])
        spec_tps.append(tokens["spec"] / elapsed["spec"])
        speedups.append(spec_tps[-1] / plain_tps[-1])
    middle = sorted(range(repeats), key=lambda i: speedups[i])[repeats // 2]
    stats = llm.spec_stats()
    # Steady-state medians: the median skips each request's prefill and the proposer's prompt catch-up.
    return {
        "target_ms": target_forward.steady_ms(0),
        "chain_ms": propose.steady_ms(0),
        "draft_fwd_ms": draft_forward.steady_ms(0),
        "decode_ms": forward.steady_ms(0),
        "tau": stats.mean_acceptance_length,
        "per_position": stats.acceptance_per_position,
        "plain_tok_s": plain_tps[middle],
        "tok_s": spec_tps[middle],
        "speedups": speedups,
        "same": sum(a.token_ids == b.token_ids for a, b in zip(plain_outputs, outputs)),
        "requests": len(outputs),
    }


def default_pair() -> tuple[str, str] | None:
    """The zoo's MiniMax-M3-shaped target and its EAGLE3 draft, when built."""
    from specdec.zoo import zoo_path

    try:
        return str(zoo_path("minimax-m3-tiny")), str(zoo_path("minimax-m3-tiny-eagle3"))
    except FileNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target checkpoint folder (default: the zoo's minimax-m3-tiny, else random)")
    parser.add_argument("--draft", help="EAGLE3 draft folder for the target (default: the zoo's, else random)")
    parser.add_argument("--random", action="store_true", help="use the random llama pair even if the zoo is built")
    parser.add_argument("--k", default="1,3,5", help="comma-separated num_speculative_tokens")
    parser.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's: bf16 for the zoo) | float32 | ...")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs; the median speedup is printed")
    args = parser.parse_args()
    if bool(args.target) != bool(args.draft):
        parser.error("give --target and --draft together")
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        vocab = 4096
        pair = (args.target, args.draft) if args.target else (None if args.random else default_pair())
        if pair is None:
            target = small_llama(str(Path(tmp) / "target"), 512, 8, vocab, seed=0)
            pair, source = (target, random_eagle3_draft(str(Path(tmp) / "draft"), target, vocab // 4)), "random"
        else:
            source = "trained"
        target, draft = pair
        prompts = validation_prompts(target, args.num_prompts, args.prompt_len) or [
            [(13 * i + 7 * j) % 1000 + 3 for j in range(args.prompt_len)] for i in range(args.num_prompts)
        ]
        print(f"target {target}\ndraft  {draft}  ({source}; {len(prompts)} prompts of {args.prompt_len} tokens, "
              f"{args.max_tokens} new, greedy, dtype {args.dtype}, {args.threads} threads)")
        header = (f"{'k':>2} {'batch':>5} {'decode ms':>9} {'verify ms':>9} {'verify/decode':>13} {'chain ms':>8} "
                  f"{'c':>5} {'tau':>5} {'alpha':>5} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} "
                  f"{'ideal':>5} {'of ideal':>8} {'same':>5}")
        print(header)
        print("-" * len(header))
        notes = []
        for k in map(int, args.k.split(",")):
            for batch in map(int, args.batch.split(",")):
                r = measure(target, draft, k, batch, args.max_tokens, prompts, args.dtype, args.repeats)
                c = r["draft_fwd_ms"] / r["decode_ms"]
                ratio = r["target_ms"] / r["decode_ms"]
                ideal = r["tau"] / (k * c + 1)  # FACTS.md section 2, with the measured tau
                speedup = r["tok_s"] / r["plain_tok_s"]
                print(f"{k:>2} {batch:>5} {r['decode_ms']:>9.2f} {r['target_ms']:>9.2f} {ratio:>13.2f} "
                      f"{r['chain_ms']:>8.2f} {c:>5.2f} {r['tau']:>5.2f} {alpha_from_tau(r['tau'], k):>5.2f} "
                      f"{r['plain_tok_s']:>11.1f} {r['tok_s']:>10.1f} {speedup:>6.2f}x {ideal:>4.2f}x "
                      f"{speedup / ideal:>8.0%} {r['same']:>2}/{r['requests']}")
                per = ", ".join(f"{a:.3f}" for a in r["per_position"])
                # What the ideal leaves out: the verify forward costs `ratio` decode steps, not one.
                runs = ", ".join(f"{x:.2f}x" for x in r["speedups"])
                notes.append(f"k={k} batch={batch}: acceptance per position {per}; with the measured verify cost "
                             f"the bound is tau / (k c + verify/decode) = {r['tau'] / (k * c + ratio):.2f}x; "
                             f"speedup per interleaved run {runs}")
        print("\n".join(notes))
        print("ideal = tau / (k c + 1), FACTS.md section 2 (tau = (1 - alpha^(k+1)) / (1 - alpha) for i.i.d. alpha)")


if __name__ == "__main__":
    main()
