"""The frozen transformers target that draft training reads: aux hidden states, logits, one layer's K/V."""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdec.train.tokenizer import PAD_ID

_MOE_TYPES = ("deepseek_v3", "kimi_k2", "minimax_m2", "minimax_m3_vl_text")


class HFTarget:
    """A frozen transformers target: aux hidden states, logits and (optionally) one layer's K/V."""

    def __init__(self, folder: str | Path, autocast: bool = True, dtype: torch.dtype = torch.float32):
        from transformers import AutoModelForCausalLM

        from specdec.models.loader import read_config_json

        self.folder = Path(folder)
        raw = read_config_json(self.folder)
        kwargs = {"experts_implementation": "grouped_mm"} if raw.get("model_type") in _MOE_TYPES else {}
        if dtype == torch.float64 and kwargs:
            kwargs["experts_implementation"] = "eager"  # the grouped-mm expert kernel has no float64
        # fp32 copy of the (bf16) checkpoint by default; the forward runs under bf16 autocast like training.
        self.model = AutoModelForCausalLM.from_pretrained(str(self.folder), local_files_only=True, dtype=dtype,
                                                          **kwargs)
        self.model.requires_grad_(False)
        self.model.eval()
        self.config = self.model.config
        self.autocast = autocast
        self.num_layers = self.config.num_hidden_layers
        self.hidden_size = self.config.hidden_size
        self.vocab_size = self.config.vocab_size

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(input_ids)

    def output_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, aux_layer_ids, kv_layer: int | None = None):
        """``(aux [B, S, n*H], logits [B, S, V] fp32, (k, v) [B, kv, S, D] or None)`` for windows ``[B, S]``."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(input_ids=input_ids, output_hidden_states=True, use_cache=kv_layer is not None)
        work = torch.float64 if out.logits.dtype == torch.float64 else torch.float32
        aux = torch.cat([out.hidden_states[i] for i in aux_layer_ids], dim=-1).to(work)
        kv = None
        if kv_layer is not None:
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            layer = cache.layers[kv_layer]
            kv = (layer.keys.to(work), layer.values.to(work))
        return aux, out.logits.to(work), kv

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, total_len: int, batch_size: int, progress: bool = False,
                 desc: str = "generate") -> torch.Tensor:
        """Greedy continuations of ``prompts [N, P]`` to ``total_len`` tokens each (never stopping early)."""
        new = total_len - prompts.shape[1]
        if new <= 0:
            raise ValueError(f"total_len ({total_len}) must exceed the prompt length ({prompts.shape[1]})")
        out = []
        bar = tqdm(total=prompts.shape[0], desc=desc, disable=not progress, dynamic_ncols=True)
        for start in range(0, prompts.shape[0], batch_size):
            chunk = prompts[start : start + batch_size]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
                # eos_token_id=None with min_new_tokens: every window is full length, EOS included as text.
                seqs = self.model.generate(chunk, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                           eos_token_id=None, pad_token_id=PAD_ID,
                                           attention_mask=torch.ones_like(chunk))
            out.append(seqs[:, :total_len])
            bar.update(chunk.shape[0])
        bar.close()
        return torch.cat(out)

    def layer_kv_layouts(self) -> list[tuple | None]:
        """Each layer's cached K/V in serving's terms (:func:`~specdec.proposers.eagle3.kv_sharing.pool_layout`):
        ``("attention", kv_heads, head_dim, head_dim)``, or None where it is not plain MHA/GQA."""
        config = self.config
        if getattr(config, "kv_lora_rank", None):
            return [None] * self.num_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return [("attention", kv_heads, head_dim, head_dim)] * self.num_layers
