"""Next-token training of a target LM (transformers model classes) on the offline corpus.

The result is an ordinary checkpoint folder (``config.json``, ``model.safetensors`` in bf16,
``generation_config.json``, the tokenizer files) plus ``training.json`` recording how it was made.
Training runs under bf16 autocast with fp32 master weights (about 2.5x faster than fp32 on the
project's CPUs); a fixed seed and thread count give the same weights run after run.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from specdec.train.balance import RouterBalancer
from specdec.train.corpus import corpus_fingerprint, load_documents
from specdec.train.data import (
    WindowBatches,
    spread_windows,
    tokenize_documents,
    windows,
)
from specdec.train.presets import TargetPreset, get_preset
from specdec.train.records import complete_target_config
from specdec.train.run import RunOptions, write_training_record
from specdec.train.schedule import adamw, cosine_lr, set_lr
from specdec.train.tokenizer import (
    TokenizerConfig,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)


def _preset(value: TargetPreset | str) -> TargetPreset:
    return get_preset(value) if isinstance(value, str) else value


@attrs.frozen(kw_only=True)
class TargetTrainConfig(RunOptions):
    """One target training run."""

    preset: TargetPreset = attrs.field(converter=_preset)
    output_dir: str = attrs.field(converter=str)
    tokenizer_dir: str | None = None  # None: train a tokenizer on the corpus and save it with the model
    eval_every: int = attrs.field(default=200, validator=attrs.validators.ge(1))
    eval_windows: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    # torch.compile the training forward (inductor; needs a C++ compiler): about 1.5x faster on
    # the zoo presets after a compile of a minute or two. Evaluation runs the eager model.
    compile: bool = False
    tokenizer: TokenizerConfig = attrs.field(factory=TokenizerConfig)


@attrs.frozen
class TrainResult:
    """What a training run produced and how it went."""

    output_dir: Path
    steps: int
    train_losses: list[float]  # per step, mean next-token cross-entropy (nats)
    val_losses: list[tuple[int, float]]  # (step, validation loss)
    tokens_per_second: float
    num_parameters: int


def prepare_tokenizer(config: TargetTrainConfig, train_docs):
    """The run's tokenizer: loaded from ``tokenizer_dir`` or trained on the corpus' train split."""
    if config.tokenizer_dir is not None:
        return load_tokenizer(config.tokenizer_dir)
    return train_tokenizer((d.text for d in train_docs), config.tokenizer)


def lm_loss(model, batch: torch.Tensor, autocast: bool) -> torch.Tensor:
    """Mean next-token cross-entropy of windows ``[B, T+1]`` (inputs ``[:, :-1]``, labels ``[:, 1:]``)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, val: torch.Tensor, autocast: bool, batch_size: int) -> float:
    """Mean validation loss over the fixed windows ``val``."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, val.shape[0], batch_size):
        chunk = val[start : start + batch_size]
        total += float(lm_loss(model, chunk, autocast)) * chunk.shape[0]
        count += chunk.shape[0]
    model.train(was_training)
    return total / count


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)


def train_target(config: TargetTrainConfig) -> TrainResult:
    """Train ``config.preset`` on the corpus and save the checkpoint folder; see the module docstring."""
    preset = config.preset
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    train_docs = load_documents("train", config.corpus)
    val_docs = load_documents("validation", config.corpus)
    tokenizer = prepare_tokenizer(config, train_docs)
    train_stream = tokenize_documents(tokenizer, train_docs)
    val_windows = spread_windows(windows(tokenize_documents(tokenizer, val_docs), preset.seq_len + 1),
                                 config.eval_windows)

    _seed_everything(config.seed)
    model = preset.build_model(len(tokenizer))
    forward_model = torch.compile(model) if config.compile else model
    batches = iter(WindowBatches(train_stream, preset.seq_len, preset.batch_size, seed=config.seed))
    optimizer = adamw(model, preset.lr, preset.weight_decay)
    balancer = RouterBalancer(model, preset.router_bias_rate)
    total = config.total_steps

    train_losses: list[float] = []
    val_losses: list[tuple[int, float]] = []
    bar = tqdm(total=total, desc=f"train {preset.name}", disable=not config.progress, dynamic_ncols=True)
    start = time.perf_counter()
    smoothed = None
    for step in range(total):
        set_lr(optimizer, cosine_lr(step, total=total, peak=preset.lr, warmup=preset.warmup_steps,
                                    min_ratio=preset.min_lr_ratio))
        loss = lm_loss(forward_model, next(batches), config.autocast)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{preset.name}: loss became {float(loss)} at step {step}; lower the lr")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), preset.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        imbalance = balancer.step()
        value = float(loss.detach())
        train_losses.append(value)
        smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
        if (step + 1) % config.eval_every == 0 or step + 1 == total:
            val_losses.append((step + 1, evaluate(model, val_windows, config.autocast, preset.batch_size)))
            balancer.discard()
        elapsed = time.perf_counter() - start
        postfix = {"loss": f"{smoothed:.3f}", "tok/s": f"{(step + 1) * preset.tokens_per_step / elapsed:.0f}"}
        if val_losses:
            postfix["val"] = f"{val_losses[-1][1]:.3f}"
        if balancer.routers:
            postfix["load"] = f"{imbalance:.2f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - start
    balancer.remove()

    result = TrainResult(
        output_dir=Path(config.output_dir),
        steps=total,
        train_losses=train_losses,
        val_losses=val_losses,
        tokens_per_second=total * preset.tokens_per_step / elapsed,
        num_parameters=sum(p.numel() for p in model.parameters()),
    )
    metadata = {
        "preset": attrs.asdict(preset),
        "steps": total,
        "seed": config.seed,
        "threads": torch.get_num_threads(),
        "autocast_bf16": config.autocast,
        "compiled": config.compile,
        "tokens_seen": total * preset.tokens_per_step,
        "train_tokens_in_corpus": int(train_stream.numel()),
        "final_train_loss": sum(train_losses[-20:]) / len(train_losses[-20:]),
        "val_losses": val_losses,
        "num_parameters": result.num_parameters,
        "corpus_fingerprint": corpus_fingerprint(train_docs),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    save_checkpoint(model, tokenizer, config.output_dir, metadata)
    return result


# Bundled files stay under the repository's 20 MB per-file limit; bigger checkpoints are sharded
# with an index, which both transformers and specdec's loader read.
MAX_SHARD_SIZE = "16MB"


def save_checkpoint(model, tokenizer, folder: str | Path, metadata: dict | None = None) -> Path:
    """Write the model in bf16 with its tokenizer, generation config and (optionally) ``training.json``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.eval()
    model.config.use_cache = True
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (
        model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id,
    )
    model.save_pretrained(str(folder), max_shard_size=MAX_SHARD_SIZE)
    complete_target_config(folder)
    save_tokenizer(tokenizer, folder)
    if metadata is not None:
        write_training_record(folder, metadata)
    return folder


def measure_throughput(preset: TargetPreset | str, steps: int = 3, threads: int | None = None,
                       autocast: bool = True, vocab_size: int = 4096, compile: bool = False) -> dict:
    """Training tokens/s of a preset on random tokens (one warm-up step, then ``steps`` timed ones).

    Also reports the projected wall time of the full and quick schedules at that speed.
    """
    preset = _preset(preset)
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = preset.build_model(vocab_size)
    optimizer = adamw(model, preset.lr, preset.weight_decay)
    forward_model = torch.compile(model) if compile else model
    generator = torch.Generator().manual_seed(0)
    times = []
    for i in range(steps + 1):
        batch = torch.randint(3, vocab_size, (preset.batch_size, preset.seq_len + 1), generator=generator)
        t0 = time.perf_counter()
        lm_loss(forward_model, batch, autocast).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i > 0:
            times.append(time.perf_counter() - t0)
    # The fastest step estimates the uncontended cost (the 2 CPU cores are shared); the median shows contention.
    step_s = min(times)
    median_s = sorted(times)[len(times) // 2]
    return {
        "preset": preset.name,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
        "compiled": compile,
        "tokens_per_step": preset.tokens_per_step,
        "best_step_s": round(step_s, 3),
        "median_step_s": round(median_s, 3),
        "tokens_per_second": round(preset.tokens_per_step / step_s, 1),
        "full_run_minutes": round(preset.steps * step_s / 60, 1),
        "quick_run_minutes": round(preset.quick_steps * step_s / 60, 1),
    }
