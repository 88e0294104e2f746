"""Test helpers for EAGLE3 drafts: tiny checkpoints in every published layout, and an independent
reference forward written from FACTS.md section 3 (plain torch, float64, full recomputation, no cache).

Nothing here imports specdec's draft code: the reference reads the canonical weight dict the
checkpoint was written from.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

LAYOUTS = ("eagle", "sglang", "sglang_model", "vllm", "vllm_model", "mla")
TARGET_LAYERS = 8


# ----------------------------------------------------------------------------- targets
def save_llama_target(folder: Path, num_layers: int = TARGET_LAYERS):
    """A tiny transformers Llama saved with save_pretrained; returns the (float64) transformers model."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return model.double().eval()


def save_deepseek_target(folder: Path, kv_lora_rank: int = 16, qk_rope_head_dim: int = 4) -> None:
    """A tiny transformers DeepSeek-V3 (MLA, one dense then MoE layers) saved with save_pretrained."""
    torch.manual_seed(1)
    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=8, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=8, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
        rope_theta=10000.0, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    )
    DeepseekV3ForCausalLM(config).save_pretrained(folder)


@attrs.define
class DraftSpec:
    """What to write. ``aux_ids=None`` leaves the ids to the default (2, L//2, L-3)."""

    layout: str = "sglang"
    hidden: int = 32
    target_hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    intermediate: int = 48
    vocab: int = 64
    draft_vocab: int = 64
    aux_ids: tuple[int, ...] | None = (0, 3, 7)
    fc_norm: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    flags_in_eagle_config: bool = False
    own_embed: bool = False
    own_lm_head: bool = True
    with_d2t: bool | None = None  # None: exactly when draft_vocab < vocab
    with_t2d: bool = True
    eps: float = 1e-5
    theta: float = 10000.0
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 16
    nope: int = 8
    rope: int = 4
    v_head_dim: int = 8

    @property
    def is_mla(self) -> bool:
        return self.layout == "mla"

    @property
    def num_aux(self) -> int:
        return 3 if self.aux_ids is None else len(self.aux_ids)


# ----------------------------------------------------------------------------- checkpoints
def make_weights(spec: DraftSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float64 weights by canonical name (``midlayer.*``, ``fc.weight``, ...), plus d2t / t2d."""
    gen = torch.Generator().manual_seed(seed)

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=gen, dtype=torch.float64) * gain / math.sqrt(in_f)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=gen, dtype=torch.float64)

    H, Ht, n = spec.hidden, spec.target_hidden, spec.num_aux
    w: dict[str, torch.Tensor] = {"fc.weight": lin(H, n * Ht)}
    if spec.fc_norm:
        for i in range(n):
            w[f"fc_norm.{i}.weight"] = norm(Ht)
    if spec.norm_before_fc:
        w["input_norm.weight"] = norm(n * Ht)
    p = "midlayer."
    if spec.is_mla:
        qk = spec.nope + spec.rope
        if spec.q_lora_rank is None:
            w[p + "self_attn.q_proj.weight"] = lin(spec.heads * qk, 2 * H)
        else:
            w[p + "self_attn.q_a_proj.weight"] = lin(spec.q_lora_rank, 2 * H)
            w[p + "self_attn.q_a_layernorm.weight"] = norm(spec.q_lora_rank)
            w[p + "self_attn.q_b_proj.weight"] = lin(spec.heads * qk, spec.q_lora_rank)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = lin(spec.kv_lora_rank + spec.rope, 2 * H)
        w[p + "self_attn.kv_a_layernorm.weight"] = norm(spec.kv_lora_rank)
        w[p + "self_attn.kv_b_proj.weight"] = lin(spec.heads * (spec.nope + spec.v_head_dim), spec.kv_lora_rank)
        w[p + "self_attn.o_proj.weight"] = lin(H, spec.heads * spec.v_head_dim)
    else:
        w[p + "self_attn.q_proj.weight"] = lin(spec.heads * spec.head_dim, 2 * H)
        w[p + "self_attn.k_proj.weight"] = lin(spec.kv_heads * spec.head_dim, 2 * H)
        w[p + "self_attn.v_proj.weight"] = lin(spec.kv_heads * spec.head_dim, 2 * H)
        w[p + "self_attn.o_proj.weight"] = lin(H, spec.heads * spec.head_dim)
    w[p + "mlp.gate_proj.weight"] = lin(spec.intermediate, H)
    w[p + "mlp.up_proj.weight"] = lin(spec.intermediate, H)
    w[p + "mlp.down_proj.weight"] = lin(H, spec.intermediate)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[p + f"{name}.weight"] = norm(H)
    w["norm.weight"] = norm(H)
    if spec.own_embed:
        w["embed_tokens.weight"] = torch.randn(spec.vocab, H, generator=gen, dtype=torch.float64)
    if spec.own_lm_head:
        w["lm_head.weight"] = lin(spec.draft_vocab, H, gain=3.0)
    with_d2t = spec.with_d2t if spec.with_d2t is not None else spec.draft_vocab < spec.vocab
    if with_d2t:
        target_ids = torch.randperm(spec.vocab, generator=gen)[: spec.draft_vocab].sort().values
        w["d2t"] = target_ids - torch.arange(spec.draft_vocab)
        if spec.with_t2d:
            t2d = torch.zeros(spec.vocab, dtype=torch.bool)
            t2d[target_ids] = True
            w["t2d"] = t2d
    return w


def draft_config(spec: DraftSpec) -> dict:
    """The config.json each layout's publisher writes."""
    cfg: dict = {
        "model_type": "deepseek_v3" if spec.is_mla else "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": spec.eps,
        "hidden_act": "silu",
        "vocab_size": spec.vocab,
        "draft_vocab_size": spec.draft_vocab,
        "rope_theta": spec.theta,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if not spec.is_mla:
        cfg["head_dim"] = spec.head_dim
    if spec.layout == "eagle":
        cfg["architectures"] = ["LlamaForCausalLM"]
        assert spec.aux_ids is None, "the EAGLE reference layout has no eagle_config"
    elif spec.is_mla:
        cfg["architectures"] = ["Eagle3DeepseekV2ForCausalLM"]
        cfg.update(
            q_lora_rank=spec.q_lora_rank,
            kv_lora_rank=spec.kv_lora_rank,
            qk_nope_head_dim=spec.nope,
            qk_rope_head_dim=spec.rope,
            v_head_dim=spec.v_head_dim,
            # A Kimi-style draft config carries the target's MoE keys; the dense draft ignores them.
            n_routed_experts=8,
            num_experts_per_tok=2,
        )
    else:
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]
    if spec.layout != "eagle":
        eagle = {"use_aux_hidden_state": True}
        if spec.aux_ids is not None:
            eagle["eagle_aux_hidden_state_layer_ids"] = list(spec.aux_ids)
        cfg["eagle_config"] = eagle
        cfg["target_hidden_size"] = spec.target_hidden
    flags = {
        name: True
        for name in ("fc_norm", "norm_output", "norm_before_residual", "norm_before_fc")
        if getattr(spec, name)
    }
    if spec.flags_in_eagle_config:
        cfg["eagle_config"].update(flags)
    else:
        cfg.update(flags)
    return cfg


def checkpoint_name(layout: str, name: str) -> str:
    """Rename a canonical tensor name into ``layout``'s spelling."""
    if name.startswith("midlayer."):
        rest = name[len("midlayer.") :]
        layer = {
            "eagle": "midlayer.",
            "sglang": "midlayer.",
            "mla": "midlayer.",
            "sglang_model": "model.midlayer.",
            "vllm": "layers.0.",
            "vllm_model": "model.layers.0.",
        }[layout]
        return layer + rest
    if layout in ("sglang_model", "vllm_model") and name not in ("lm_head.weight", "d2t", "t2d"):
        return "model." + name
    return name


def write_draft(
    folder: Path,
    spec: DraftSpec,
    weights: dict[str, torch.Tensor],
    *,
    config: dict | None = None,
    rename=None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (float64 tensors, real safetensors file)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config if config is not None else draft_config(spec)))
    rename = rename or (lambda n: checkpoint_name(spec.layout, n))
    tensors = {rename(n): t.contiguous() for n, t in weights.items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


# ----------------------------------------------------------------------------- reference forward
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    # Frequency tables in float32, as checkpoints are trained and served; the rest stays float64.
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos().double()[:, None, :], angles.sin().double()[:, None, :]


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [S, heads, d]``, ``k [T, heads, d]``, ``v [T, heads, dv]`` -> ``[S, heads, dv]``: the queries are
    the last ``S`` of ``T`` positions, query i sees keys ``<= T - S + i``."""
    S, T = q.shape[0], k.shape[0]
    scores = torch.einsum("shd,thd->hst", q, k) * scale
    mask = torch.ones(S, T, dtype=torch.bool).tril(diagonal=T - S)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hst,thd->shd", probs, v)


def _mha(w, spec: DraftSpec, x: torch.Tensor, positions: torch.Tensor, prefix: dict | None = None) -> torch.Tensor:
    """``prefix``: cached (roped) ``k`` and ``v`` of positions before ``positions`` (a target layer's, read
    by a KV-sharing draft), attended to first."""
    p = "midlayer.self_attn."
    S = x.shape[0]
    q = (x @ w[p + "q_proj.weight"].T).view(S, spec.heads, spec.head_dim)
    k = (x @ w[p + "k_proj.weight"].T).view(S, spec.kv_heads, spec.head_dim)
    v = (x @ w[p + "v_proj.weight"].T).view(S, spec.kv_heads, spec.head_dim)
    cos, sin = rope_cos_sin(positions, spec.head_dim, spec.theta)
    q, k = rope_halves(q, cos, sin), rope_halves(k, cos, sin)
    if prefix is not None:
        k, v = torch.cat([prefix["k"], k]), torch.cat([prefix["v"], v])
    group = spec.heads // spec.kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = causal_attention(q, k, v, spec.head_dim**-0.5)
    return out.reshape(S, -1) @ w[p + "o_proj.weight"].T


def _mla(w, spec: DraftSpec, x: torch.Tensor, positions: torch.Tensor, prefix: dict | None = None) -> torch.Tensor:
    """Naive (expanded) MLA: per-head keys and values from kv_b_proj, as DeepSeek-V2 writes it.
    ``prefix``: the cached ``latent`` (normalised compressed KV, then the roped key part) of positions
    before ``positions``, expanded and attended to first."""
    p = "midlayer.self_attn."
    S, nope, rope = x.shape[0], spec.nope, spec.rope
    if spec.q_lora_rank is None:
        q = x @ w[p + "q_proj.weight"].T
    else:
        q = rms(x @ w[p + "q_a_proj.weight"].T, w[p + "q_a_layernorm.weight"], spec.eps) @ w[p + "q_b_proj.weight"].T
    q = q.view(S, spec.heads, nope + rope)
    kv_a = x @ w[p + "kv_a_proj_with_mqa.weight"].T
    rank = spec.kv_lora_rank
    c = rms(kv_a[:, :rank], w[p + "kv_a_layernorm.weight"], spec.eps)
    cos, sin = rope_cos_sin(positions, rope, spec.theta)
    q_pe = rope_pairs(q[..., nope:], cos, sin)
    k_pe = rope_pairs(kv_a[:, None, rank:], cos, sin)
    if prefix is not None:
        latent = prefix["latent"]
        c, k_pe = torch.cat([latent[:, :rank], c]), torch.cat([latent[:, None, rank:], k_pe])
    T = c.shape[0]
    kv = (c @ w[p + "kv_b_proj.weight"].T).view(T, spec.heads, nope + spec.v_head_dim)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k_pe = k_pe.expand(T, spec.heads, rope)
    query = torch.cat([q[..., :nope], q_pe], dim=-1)
    key = torch.cat([k_nope, k_pe], dim=-1)
    out = causal_attention(query, key, v, (nope + rope) ** -0.5)
    return out.reshape(S, -1) @ w[p + "o_proj.weight"].T


@attrs.define
class Reference:
    """The EAGLE3 draft computed from scratch; ``target_embed`` / ``target_lm_head`` fill in shared weights."""

    spec: DraftSpec
    w: dict[str, torch.Tensor]
    target_embed: torch.Tensor
    target_lm_head: torch.Tensor

    @property
    def target_ids(self) -> torch.Tensor:
        d2t = self.w.get("d2t", torch.zeros(self.spec.draft_vocab, dtype=torch.int64))
        return torch.arange(self.spec.draft_vocab) + d2t

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if s.norm_before_fc:
            aux = rms(aux, self.w["input_norm.weight"], s.eps)
        if s.fc_norm:
            chunks = aux.split(s.target_hidden, dim=-1)
            aux = torch.cat([rms(c, self.w[f"fc_norm.{i}.weight"], s.eps) for i, c in enumerate(chunks)], dim=-1)
        return aux @ self.w["fc.weight"].T

    def layer(self, tokens: list[int], hidden: torch.Tensor, positions: torch.Tensor, prefix: dict | None = None):
        """Full recomputation over a whole draft sequence: (post-norm, fed-back hidden), ``[S, H]`` each;
        ``prefix``: cached KV of earlier positions the layer attends to first (see :func:`_mha`, :func:`_mla`)."""
        s, w, p = self.spec, self.w, "midlayer."
        embed = w.get("embed_tokens.weight", self.target_embed)[torch.tensor(tokens)]
        e = rms(embed, w[p + "input_layernorm.weight"], s.eps)
        hn = rms(hidden, w[p + "hidden_norm.weight"], s.eps)
        x = torch.cat([e, hn], dim=-1)
        attn = (_mla if s.is_mla else _mha)(w, s, x, positions, prefix)
        h = (hn if s.norm_before_residual else hidden) + attn
        m = rms(h, w[p + "post_attention_layernorm.weight"], s.eps)
        h = h + (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"
        ].T
        post = rms(h, w["norm.weight"], s.eps)
        return post, (post if s.norm_output else h)

    def logits(self, post: torch.Tensor) -> torch.Tensor:
        lm_head = self.w.get("lm_head.weight")
        if lm_head is None:
            lm_head = self.target_lm_head[self.target_ids]
        return post @ lm_head.T

    def chain(self, tokens: list[int], aux: torch.Tensor, k: int, start: int = 0) -> dict:
        """Shifted prefill over ``tokens`` (token p+1 with hidden h_p) then greedy chain drafting of k tokens.

        Returns the prefill outputs and, per draft step, the draft logits, the drafted target id and
        the hidden fed to the next step.
        """
        tokens = list(tokens)
        hidden = self.fuse(aux)
        post, nxt = self.layer(tokens, hidden, torch.arange(start, start + len(tokens)))
        out = {"prefill_post": post, "prefill_next": nxt, "logits": [], "drafts": [], "next": []}
        for step in range(k):
            if step:
                post, nxt = self.layer(tokens, hidden, torch.arange(start, start + len(tokens)))
            logits = self.logits(post[-1])
            draft = int(self.target_ids[int(logits.argmax())])
            out["logits"].append(logits)
            out["drafts"].append(draft)
            out["next"].append(nxt[-1])
            tokens.append(draft)
            hidden = torch.cat([hidden, nxt[-1:]], dim=0)
        return out
