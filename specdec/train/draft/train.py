"""``train_draft``: one draft training run against a trained target folder, saved as a servable checkpoint."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import attrs
import torch
from tqdm.auto import tqdm

from specdec.proposers.draft_record import weights_fingerprint
from specdec.train.corpus import corpus_fingerprint, load_documents
from specdec.train.data import (
    WindowBatches,
    spread_windows,
    tokenize_documents,
    windows,
)
from specdec.train.draft.build import (
    build_draft,
    draft_config_dict,
    resolve_aux_layer_ids,
    resolve_kv_sharing_layer,
    save_draft,
)
from specdec.train.draft.evaluate import evaluate_draft
from specdec.train.draft.hf_target import HFTarget
from specdec.train.draft.loss import random_splits, ttt_forward
from specdec.train.draft.presets import DraftPreset, as_draft_preset
from specdec.train.run import RunOptions
from specdec.train.schedule import adamw, cosine_lr, set_lr
from specdec.train.tokenizer import EOS_ID, load_tokenizer
from specdec.train.vocab import DraftVocab, frequency_vocab


@attrs.frozen(kw_only=True)
class DraftTrainConfig(RunOptions):
    """One draft training run against a trained target folder."""

    preset: DraftPreset = attrs.field(converter=as_draft_preset)
    target_dir: str = attrs.field(converter=str)
    output_dir: str = attrs.field(converter=str)
    eval_every: int = attrs.field(default=100, validator=attrs.validators.ge(1))
    eval_windows: int = attrs.field(default=16, validator=attrs.validators.ge(1))


@attrs.frozen
class DraftTrainResult:
    output_dir: Path
    steps: int
    train_losses: list[float]
    val_accuracy: list[tuple[int, list[float]]]  # (step, per-TTT-step top-1 agreement on corpus windows)
    # (step, greedy acceptance per position at k=3, replayed on the target's own greedy text)
    val_acceptance: list[tuple[int, list[float]]]
    tokens_per_second: float
    num_parameters: int  # trainable (saved) parameters


def train_draft(config: DraftTrainConfig) -> DraftTrainResult:
    """Train the draft preset against ``config.target_dir`` and save it to ``config.output_dir``."""
    preset = config.preset
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    target = HFTarget(config.target_dir, autocast=config.autocast)
    tokenizer = load_tokenizer(config.target_dir)
    if len(tokenizer) != target.vocab_size:
        raise ValueError(f"the target's tokenizer has {len(tokenizer)} tokens but its config says vocab_size "
                         f"{target.vocab_size}; retrain the target with specdec.train")
    train_docs = load_documents("train", config.corpus)
    val_docs = load_documents("validation", config.corpus)
    train_stream = tokenize_documents(tokenizer, train_docs)
    val_windows = spread_windows(windows(tokenize_documents(tokenizer, val_docs), preset.seq_len), config.eval_windows)

    vocab = frequency_vocab(train_stream, target.vocab_size, preset.draft_vocab_size, always=(EOS_ID,))
    aux_ids = resolve_aux_layer_ids(preset, target)
    draft_cfg = draft_config_dict(preset, target, vocab, aux_ids, kv_layer=None)
    draft = build_draft(draft_cfg, aux_ids, target, vocab, preset.own_lm_head, config.seed)
    attn = draft.midlayer.self_attn
    kv_layer = None
    if preset.kv_sharing:
        kv_layer = resolve_kv_sharing_layer(preset, target, attn.num_kv_heads, attn.head_dim)
        draft_cfg = draft_config_dict(preset, target, vocab, aux_ids, kv_layer=kv_layer)

    # The target's own greedy text: validation windows always (the acceptance estimate), training
    # windows when the preset asks for them.
    val_prompts = val_windows[:, : preset.generation_prompt_len]
    val_generated = target.generate(val_prompts, preset.seq_len, preset.generation_batch, config.progress,
                                    desc="generate val")
    n_gen = preset.generated_per_batch
    corpus_batches = iter(WindowBatches(train_stream, preset.seq_len - 1, preset.batch_size - n_gen,
                                        seed=config.seed)) if n_gen < preset.batch_size else None
    generated_batches = None
    if n_gen:
        pool = windows(train_stream, preset.seq_len)
        pick = torch.randperm(pool.shape[0], generator=torch.Generator().manual_seed(config.seed + 2))
        # --quick scales generation down with the steps.
        count = max(n_gen, preset.generated_windows // 10) if config.quick else preset.generated_windows
        prompts = pool[pick[:count], : preset.generation_prompt_len]
        generated = target.generate(prompts, preset.seq_len, preset.generation_batch, config.progress,
                                    desc="generate train")
        generated_batches = iter(WindowBatches.from_windows(generated, n_gen, seed=config.seed + 3))

    def next_batch() -> torch.Tensor:
        parts = [next(it) for it in (generated_batches, corpus_batches) if it is not None]
        return torch.cat(parts)

    split_gen = torch.Generator().manual_seed(config.seed + 1)
    optimizer = adamw(draft, preset.lr, preset.weight_decay)
    total = config.total_steps
    train_losses: list[float] = []
    val_accuracy: list[tuple[int, list[float]]] = []
    val_acceptance: list[tuple[int, list[float]]] = []
    bar = tqdm(total=total, desc=f"draft {preset.name}", disable=not config.progress, dynamic_ncols=True)
    start = time.perf_counter()
    smoothed = None
    for step in range(total):
        set_lr(optimizer, cosine_lr(step, total=total, peak=preset.lr, warmup=preset.warmup_steps,
                                    min_ratio=preset.min_lr_ratio))
        batch = next_batch()
        split = random_splits(split_gen, batch.shape[0], batch.shape[1], kv_layer is not None)
        out = ttt_forward(draft, target, batch, preset, vocab, kv_layer, split, config.autocast)
        if not torch.isfinite(out.loss):
            raise FloatingPointError(f"{preset.name}: draft loss became {float(out.loss)} at step {step}; lower the lr")
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in draft.parameters() if p.requires_grad], preset.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = float(out.loss.detach())
        train_losses.append(value)
        smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
        if (step + 1) % config.eval_every == 0 or step + 1 == total:
            corpus_eval = evaluate_draft(draft, target, val_windows, preset, vocab, kv_layer, config.autocast)
            own_eval = evaluate_draft(draft, target, val_generated, preset, vocab, kv_layer, config.autocast,
                                      prompt_len=preset.generation_prompt_len)
            val_accuracy.append((step + 1, corpus_eval.agreement))
            val_acceptance.append((step + 1, own_eval.acceptance))
        elapsed = time.perf_counter() - start
        acc = [c / max(s, 1) for c, s in zip(out.step_correct, out.step_scored)]
        postfix = {"loss": f"{smoothed:.3f}", "acc": "/".join(f"{a:.2f}" for a in acc[:4]),
                   "tok/s": f"{(step + 1) * preset.tokens_per_step / elapsed:.0f}"}
        if val_acceptance:
            postfix["accept"] = "/".join(f"{a:.2f}" for a in val_acceptance[-1][1][:3])
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - start

    trainable = sum(p.numel() for p in draft.parameters())
    metadata = {
        "preset": attrs.asdict(preset),
        "target": str(Path(config.target_dir).resolve().name),
        "target_fingerprint": weights_fingerprint(config.target_dir),  # what serving checks the target against
        "steps": total,
        "seed": config.seed,
        "threads": torch.get_num_threads(),
        "autocast_bf16": config.autocast,
        "aux_layer_ids": list(aux_ids),
        "kv_sharing_target_layer": kv_layer,
        "draft_vocab_size": vocab.size,
        "draft_vocab_coverage": _coverage(train_stream, vocab),
        "final_train_loss": sum(train_losses[-20:]) / len(train_losses[-20:]),
        "generated_windows": 0 if generated_batches is None else int(generated.shape[0]),
        "val_top1_agreement_per_step": val_accuracy,
        "val_greedy_acceptance_per_position": val_acceptance,
        "val_mean_acceptance_length_k3": 1.0 + sum(val_acceptance[-1][1]) if val_acceptance else None,
        "num_parameters": trainable,
        "corpus_fingerprint": corpus_fingerprint(train_docs),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    save_draft(draft, draft_cfg, vocab, config.output_dir, metadata)
    return DraftTrainResult(Path(config.output_dir), total, train_losses, val_accuracy, val_acceptance,
                            total * preset.tokens_per_step / elapsed, trainable)


def _coverage(stream: torch.Tensor, vocab: DraftVocab) -> float:
    """Fraction of corpus tokens the draft vocabulary can propose."""
    return round(float(vocab.t2d[stream].float().mean()), 4)
