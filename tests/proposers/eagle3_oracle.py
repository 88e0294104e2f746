"""Tiny target / EAGLE3-draft pairs whose drafts are often right, so speculation really accepts tokens.

Random drafts are almost never accepted, which would leave a losslessness test with nothing to
check. Here the target is made *nearly bigram*: its token embeddings are scaled up, so the residual
stream (and hence the next-token choice) is dominated by the current token, with the decoder layers
as a perturbation. The draft is built to compute that bigram: its attention puts (almost) all
weight on rows holding its own input token (queries = keys = a sharp copy of the normalised
embedding, values = the embedding), a large o_proj makes that dominate the residual, and its
output head is the target's. The draft at position p receives token p+1 and so predicts token p+2
as the target would.

Chain steps feed the draft's own state back as the residual. Pre-norm (the default), that state is
GAIN-sized and would drown the new token, so ``fc`` is built to make the target's state look alike
(GAIN x the normalised embedding of token p, from aux layer 0) and the values subtract the
normalised hidden: residual + attention = GAIN x (this token) either way. With ``norm_output`` or
``norm_before_residual`` the residual is unit-sized, so fc stays small and nothing is subtracted.
The rest (fc on the other aux layers, fc_norm / input_norm beyond the first chunk, the MLP) keeps
small random weights, so each checkpoint layout and flag still changes the numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from eagle3_reference import DraftSpec, make_weights, write_draft

SHARP = 4.0  # query/key gain: self-attention logits of about SHARP^2 * head_dim^0.5 over others
GAIN = 40.0  # o_proj gain: the attention output dominates the (random) residual
NOISE = 0.05  # scale of the random parts left in (fc, MLP down projection)


# ----------------------------------------------------------------------------- targets
def _scale_embedding(model, scale: float) -> None:
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)


def save_llama_target(folder: Path, *, num_layers: int = 8, scale: float = 25.0, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.1,
    )
    model = LlamaForCausalLM(config).double()
    _scale_embedding(model, scale)
    model.save_pretrained(folder)
    return folder


def save_deepseek_target(folder: Path, *, kv_lora_rank: int = 64, scale: float = 25.0, seed: int = 1) -> Path:
    """MLA target (q without LoRA, one dense then MoE layers); kv_lora_rank 64 = twice the hidden size,
    room for the MLA oracle's latent (see oracle_weights)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    config = DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, rope_theta=10000.0,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, num_nextn_predict_layers=0,
        initializer_range=0.1,
    )
    model = DeepseekV3ForCausalLM(config).double()
    _scale_embedding(model, scale)
    model.save_pretrained(folder)
    return folder


def save_minimax_m3_target(folder: Path, *, scale: float = 25.0, seed: int = 2) -> Path:
    """MiniMax-M3 text model with 128-token block-sparse attention on its first and last layers."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

    torch.manual_seed(seed)
    config = MiniMaxM3VLTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, dense_intermediate_size=24, shared_intermediate_size=8,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, index_n_heads=2, index_head_dim=16, index_block_size=128, index_topk_blocks=2,
        index_local_blocks=1, layer_types=["minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5},
        max_position_embeddings=512, bos_token_id=1, eos_token_id=2, initializer_range=0.1,
    )
    model = MiniMaxM3VLForCausalLM(config).double()
    _scale_embedding(model, scale)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def target_output_weights(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The saved target's (embedding, lm_head) weights."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    embed = next(v for k, v in tensors.items() if k.endswith("embed_tokens.weight"))
    return embed.double(), tensors["lm_head.weight"].double()


# ----------------------------------------------------------------------------- drafts
def oracle_weights(spec: DraftSpec, target_folder: Path, seed: int = 0, mix: float = 0.0) -> dict[str, torch.Tensor]:
    """``make_weights(spec)`` with the attention / output parts replaced by the bigram construction.

    ``mix`` adds that much of the random weights back on the attention inputs' hidden half, so the
    draft's KV depends on which hidden state fed each row (it barely does in the pure construction).
    """
    H = spec.hidden
    if spec.hidden != spec.target_hidden:
        raise ValueError("the oracle draft needs the target's hidden size")
    w = make_weights(spec, seed=seed)
    embed, lm_head = target_output_weights(target_folder)
    eye = torch.eye(H, dtype=torch.float64)
    zeros = torch.zeros(H, H, dtype=torch.float64)
    p = "midlayer."
    ones = torch.ones(H, dtype=torch.float64)
    small_residual = spec.norm_output or spec.norm_before_residual
    fc = w["fc.weight"] * NOISE
    if not small_residual:
        # fc reads aux layer 0 (the target's scaled embedding of token p), normalised or not.
        chunk_rms = 1.0 if (spec.fc_norm or spec.norm_before_fc) else float(embed.pow(2).mean(-1).sqrt().mean())
        fc[:, :H] = GAIN / chunk_rms * eye
        if spec.fc_norm:
            w["fc_norm.0.weight"] = ones.clone()
        if spec.norm_before_fc:
            w["input_norm.weight"][:H] = 1.0
        w[p + "hidden_norm.weight"] = ones.clone()
    w["fc.weight"] = fc
    w[p + "mlp.down_proj.weight"] = w[p + "mlp.down_proj.weight"] * NOISE
    w[p + "input_layernorm.weight"] = ones.clone()
    w["norm.weight"] = ones.clone()  # the target's final norm is the unit init
    cancel = 0.0 if small_residual else -1.0  # values subtract the normalised residual
    a = p + "self_attn."
    if spec.is_mla:
        heads, nope, rope, vdim = spec.heads, spec.nope, spec.rope, spec.v_head_dim
        if spec.q_lora_rank is not None or heads * nope != H or heads * vdim != H:
            raise ValueError("the MLA oracle needs q_lora_rank None and heads * nope = heads * v_head_dim = hidden")
        if cancel and heads * nope != H:
            raise ValueError("the MLA oracle needs heads * nope = hidden")
        # Latent = [normalised embedding (H), normalised hidden (H)] when cancelling, so kv_b can
        # build keys from the first half and values from their difference.
        rank, used = spec.kv_lora_rank, (2 * H if cancel else H)
        if rank < used:
            raise ValueError(f"the MLA oracle needs kv_lora_rank >= {used} for this spec")
        q = torch.zeros(heads, nope + rope, 2 * H, dtype=torch.float64)
        q[:, :nope, :H] = SHARP * eye.view(heads, nope, H)
        # Roped parts from the embedding too, so equal tokens at other positions score lower.
        q[:, nope:, :rope] = SHARP * torch.eye(rope, dtype=torch.float64)
        w[a + "q_proj.weight"] = q.reshape(heads * (nope + rope), 2 * H)
        kv_a = torch.zeros(rank + rope, 2 * H, dtype=torch.float64)
        kv_a[:H, :H] = eye
        if cancel:
            kv_a[H : 2 * H, H:] = eye
        kv_a[rank:, :rope] = SHARP * torch.eye(rope, dtype=torch.float64)
        w[a + "kv_a_proj_with_mqa.weight"] = kv_a
        w[a + "kv_a_layernorm.weight"] = torch.ones(rank, dtype=torch.float64)
        # The latent norm runs over all `rank` columns of which `used` are unit-rms: undo its factor.
        unit = (used / rank) ** 0.5
        kv_b = torch.zeros(heads, nope + vdim, rank, dtype=torch.float64)
        kv_b[:, :nope, :H] = SHARP * unit * eye.view(heads, nope, H)
        kv_b[:, nope:, :H] = unit * eye.view(heads, vdim, H)
        if cancel:
            kv_b[:, nope:, H:] = cancel * unit * eye.view(heads, vdim, H)
        w[a + "kv_b_proj.weight"] = kv_b.reshape(heads * (nope + vdim), rank)
        w[a + "o_proj.weight"] = GAIN * eye
    else:
        if spec.heads * spec.head_dim != H or spec.kv_heads != spec.heads:
            raise ValueError("the MHA oracle needs heads * head_dim = hidden and kv_heads = heads")
        for name, gain in (("q_proj", SHARP), ("k_proj", SHARP)):
            w[a + f"{name}.weight"] = torch.cat([gain * eye, zeros], dim=1)
        w[a + "v_proj.weight"] = torch.cat([eye, cancel * eye], dim=1)
        w[a + "o_proj.weight"] = GAIN * eye
    if mix:
        rand = make_weights(spec, seed=seed + 1)
        for name in ("q_proj", "k_proj", "v_proj", "kv_a_proj_with_mqa"):
            key = a + f"{name}.weight"
            if key in w:
                w[key] = w[key].clone()
                w[key][:, H:] += mix * rand[key][:, H:]
    target_ids = torch.arange(spec.draft_vocab) + w.get("d2t", torch.zeros(spec.draft_vocab, dtype=torch.int64))
    if spec.own_lm_head:
        w["lm_head.weight"] = lm_head[target_ids].clone()
    if spec.own_embed:
        w["embed_tokens.weight"] = embed.clone()
    return w


def write_oracle_draft(folder: Path, spec: DraftSpec, target_folder: Path, seed: int = 0, mix: float = 0.0):
    """Write the draft checkpoint; returns its weights (for the reference forward)."""
    weights = oracle_weights(spec, target_folder, seed=seed, mix=mix)
    write_draft(folder, spec, weights)
    return weights


def save_llama_mha_target(folder, *, num_layers: int = 4, max_positions: int = 512, scale: float = 25.0,
                          seed: int = 0):
    """A nearly bigram Llama (scaled embeddings, like the targets above) with kv heads = heads = 4 and
    head_dim 8, so an EAGLE3 draft's KV layout matches its layers' (KV sharing)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, max_position_embeddings=max_positions, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.1,
    )
    model = LlamaForCausalLM(config).double()
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    model.save_pretrained(folder)
    return folder
