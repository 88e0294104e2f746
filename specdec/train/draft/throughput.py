"""How fast draft training runs on this machine, against a randomly initialised target of a preset."""

from __future__ import annotations

import tempfile
import time

import torch

from specdec.train.draft.build import (
    build_draft,
    draft_config_dict,
    resolve_aux_layer_ids,
    resolve_kv_sharing_layer,
)
from specdec.train.draft.hf_target import HFTarget
from specdec.train.draft.loss import random_splits, ttt_forward
from specdec.train.draft.presets import DraftPreset, as_draft_preset
from specdec.train.presets import get_preset
from specdec.train.schedule import adamw
from specdec.train.tokenizer import EOS_ID
from specdec.train.vocab import frequency_vocab


def measure_draft_throughput(draft_preset: DraftPreset | str, target_preset: str, steps: int = 3,
                             threads: int | None = None, vocab_size: int = 4096) -> dict:
    """Draft training tokens/s against a randomly initialised target of ``target_preset`` (same cost as a trained one)."""
    preset = as_draft_preset(draft_preset)
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = get_preset(target_preset).build_model(vocab_size)
        model.to(torch.bfloat16).save_pretrained(tmp)
        target = HFTarget(tmp)
    generator = torch.Generator().manual_seed(0)
    stream = torch.randint(3, vocab_size, (preset.tokens_per_step * 4,), generator=generator)
    vocab = frequency_vocab(stream, vocab_size, preset.draft_vocab_size, always=(EOS_ID,))
    aux_ids = resolve_aux_layer_ids(preset, target)
    draft = build_draft(draft_config_dict(preset, target, vocab, aux_ids, None), aux_ids, target, vocab,
                        preset.own_lm_head, seed=0)
    attn = draft.midlayer.self_attn
    kv_layer = resolve_kv_sharing_layer(preset, target, attn.num_kv_heads, attn.head_dim) if preset.kv_sharing else None
    optimizer = adamw(draft, preset.lr, preset.weight_decay)
    times, target_times = [], []
    for i in range(steps + 1):
        batch = torch.randint(3, vocab_size, (preset.batch_size, preset.seq_len), generator=generator)
        split = random_splits(generator, preset.batch_size, preset.seq_len, kv_layer is not None)
        t0 = time.perf_counter()
        target.run(batch, aux_ids, kv_layer)
        t1 = time.perf_counter()
        ttt_forward(draft, target, batch, preset, vocab, kv_layer, split, autocast=True).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i > 0:
            times.append(time.perf_counter() - t1)  # includes the target forward ttt_forward runs
            target_times.append(t1 - t0)
    # The fastest step estimates the uncontended cost (the 2 CPU cores are shared); the median shows contention.
    step_s = min(times)
    median_s = sorted(times)[len(times) // 2]
    return {
        "preset": preset.name,
        "target": target_preset,
        "num_parameters": sum(p.numel() for p in draft.parameters()),
        "threads": torch.get_num_threads(),
        "ttt_steps": preset.ttt_steps,
        "tokens_per_step": preset.tokens_per_step,
        "best_step_s": round(step_s, 3),
        "median_step_s": round(median_s, 3),
        "target_forward_s": round(sorted(target_times)[len(target_times) // 2], 3),
        "tokens_per_second": round(preset.tokens_per_step / step_s, 1),
        "full_run_minutes": round(preset.steps * step_s / 60, 1),
        "quick_run_minutes": round(preset.quick_steps * step_s / 60, 1),
    }
