"""EAGLE3 draft cost relative to a target step on the CPU, measured inside the engine.

    python benchmarks/bench_eagle3.py [--target DIR --draft DIR] [--k 1,3,5] [--batch 1,4] [--max-tokens 48]

Without folders a small random Llama target (hidden 512, 8 layers, vocab 4096, as in
bench_spec.py) and a random EAGLE3 head for it (SGLang layout, one layer of the target's width,
a draft vocabulary of a quarter of the target's with its d2t map) are written to a temporary
folder. For each k and batch size one generation runs with speculation; the time spent in the
proposer (catch-up over the newly verified tokens + the chain of k drafts) and in the target's
verify forward are summed per step. Printed per row:

- ``target ms``: the target's verify forward (k + 1 rows per request) per step;
- ``chain ms``: the whole proposer call per step, and ``chain/target`` its ratio to the target
  forward (the aim: below 1 for k = 3);
- ``c``: one draft forward relative to a plain target decode step (the FACTS.md section 2 cost
  figure; ideal speedup = expected tokens per step / (k c + 1)).

Random weights accept almost nothing, which changes the catch-up length (one row per request per
step) but not the cost structure; pass a trained pair for acceptance figures.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench_decode import small_llama  # the script's folder is on sys.path


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


def measure(target: str, draft: str, k: int, batch: int, max_tokens: int, prompt_len: int, dtype: str) -> dict:
    from specdec import LLM, SamplingParams

    prompts = [[(13 * i + 7 * j) % 1000 + 3 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    memory = 256 << 20

    plain = LLM(target, dtype=dtype, kv_cache_memory=memory)
    plain.generate(prompts[:1], warm, use_tqdm=False)
    forward = Timer(plain.engine.runner, "forward")
    plain.generate(prompts, params, use_tqdm=False)

    spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    llm = LLM(target, dtype=dtype, kv_cache_memory=memory, speculative_config=spec)
    llm.generate(prompts[:1], warm, use_tqdm=False)
    llm.reset_spec_stats()
    proposer = llm.engine.proposer
    propose = Timer(proposer, "propose")
    draft_forward = Timer(proposer, "_forward")
    target_forward = Timer(llm.engine.runner, "forward")
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    # Skipped: the target prefill, the proposer's empty call in that step and its prompt catch-up.
    return {
        "target_ms": target_forward.steady_ms(1),
        "chain_ms": propose.steady_ms(2),
        "draft_fwd_ms": draft_forward.steady_ms(1 + k),
        "decode_ms": forward.steady_ms(1),
        "tau": llm.spec_stats().mean_acceptance_length,
        "tok_s": sum(len(o.token_ids) for o in outputs) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target checkpoint folder (default: a random small llama)")
    parser.add_argument("--draft", help="EAGLE3 draft folder for the target (default: a random head)")
    parser.add_argument("--k", default="1,3,5", help="comma-separated num_speculative_tokens")
    parser.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        vocab = 4096
        target = args.target or small_llama(str(Path(tmp) / "target"), 512, 8, vocab, seed=0)
        draft = args.draft or random_eagle3_draft(str(Path(tmp) / "draft"), target, vocab // 4)
        print(f"{'k':>2} {'batch':>5} {'target ms':>9} {'chain ms':>8} {'chain/target':>12} {'draft fwd ms':>12} "
              f"{'decode ms':>9} {'c':>5} {'tau':>5} {'tok/s':>7}")
        for k in map(int, args.k.split(",")):
            for batch in map(int, args.batch.split(",")):
                r = measure(target, draft, k, batch, args.max_tokens, args.prompt_len, args.dtype)
                print(f"{k:>2} {batch:>5} {r['target_ms']:>9.2f} {r['chain_ms']:>8.2f} "
                      f"{r['chain_ms'] / r['target_ms']:>12.2f} {r['draft_fwd_ms']:>12.2f} {r['decode_ms']:>9.2f} "
                      f"{r['draft_fwd_ms'] / r['decode_ms']:>5.2f} {r['tau']:>5.2f} {r['tok_s']:>7.1f}")


if __name__ == "__main__":
    main()
