#!/usr/bin/env python
"""Regenerate every bundled zoo asset (specdec/zoo/*) from the offline corpus, deterministically.

    python scripts/build_zoo.py                 # full schedules (about 3 hours on 2 CPU cores)
    python scripts/build_zoo.py --compile       # the same, MiniMax-M3 target ~20 min faster (C++ compiler)
    python scripts/build_zoo.py --quick         # a tenth of the steps, to check the pipeline
    python scripts/build_zoo.py --only llama-tiny --only llama-tiny-eagle3
    python scripts/build_zoo.py --refresh         # no training: re-apply the records and layouts below

Order: the BPE tokenizer, then the targets, then the drafts against their (already built) targets.
The same seed, thread count and software versions give byte-identical weights. ``manifest.json``
records every asset's preset, steps, validation numbers and file hashes; timing goes to stdout and
to ``--log`` (it varies from run to run, so it is kept out of the bundled files).

Every trained asset is then finished (:func:`finish_asset`, which ``--refresh`` applies to built
assets without training): config keys public engines read (:mod:`specdec.train.records`), and for
drafts their target's name and weights fingerprint in ``training.json``; the ``draft_model``, trained
as a plain LM, also gets its greedy acceptance per position measured against its target.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from specdec.train.corpus import CorpusConfig, load_documents, validation_prompts
from specdec.train.draft import DraftTrainConfig, train_draft
from specdec.train.records import complete_target_config, record_target, rewrite_draft_config
from specdec.train.target import TargetTrainConfig, train_target
from specdec.train.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer
from specdec.zoo import ASSETS, BUDGET_BYTES, ZOO_DIR


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _describe(folder: Path) -> dict:
    files = sorted(p for p in folder.iterdir() if p.is_file())
    return {
        "files": {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files},
        "bytes": sum(p.stat().st_size for p in files),
    }


def default_plan() -> dict[str, tuple[str, str | None, str]]:
    """asset name -> (kind, target asset, preset): every zoo asset is trained from the preset of its name."""
    return {name: (kind, target, name) for name, (kind, target) in ASSETS.items()}


def measure_acceptance(draft: Path, target: Path, method: str, *, num_prompts: int = 8, length: int = 64,
                       k: int = 3) -> list[float]:
    """Greedy acceptance per position of ``draft`` on ``target`` in float64 (deterministic): ``num_prompts``
    held-out prompts of ``length`` tokens, as many new tokens each, ``k`` drafts a step."""
    from specdec import LLM, SamplingParams

    spec = {"method": method, "model": str(draft), "num_speculative_tokens": k}
    llm = LLM(str(target), speculative_config=spec, dtype="float64", max_num_seqs=num_prompts,
              kv_cache_memory=256 << 20)
    llm.generate(validation_prompts(target, num_prompts, length), SamplingParams(max_tokens=length, ignore_eos=True),
                 use_tqdm=False)
    return [round(a, 4) for a in llm.spec_stats().acceptance_per_position]


def finish_asset(folder: Path, kind: str, target_dir: Path | None) -> dict:
    """Bring a trained asset to the layouts and records serving reads; returns figures for the manifest."""
    if kind == "target":
        complete_target_config(folder)
        return {}
    if kind != "draft_model":
        rewrite_draft_config(folder)
        record_target(folder, target_dir)
        return {}
    rates = measure_acceptance(folder, target_dir, kind)
    steps = json.loads((folder / "training.json").read_text())["steps"]
    record_target(folder, target_dir, val_greedy_acceptance_per_position=[[steps, rates]],
                  val_mean_acceptance_length_k3=round(1 + sum(rates), 4))
    return {"val_greedy_acceptance_k3": rates, "val_mean_acceptance_length_k3": round(1 + sum(rates), 4)}


def refresh_assets(out: Path, plan: dict[str, tuple[str, str | None, str]]) -> dict:
    """:func:`finish_asset` on built assets (no training), their manifest entries updated to match."""
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for name, (kind, target_name, _preset) in plan.items():
        folder = out / name
        figures = finish_asset(folder, kind, out / target_name if target_name else None)
        manifest["assets"][name].update(figures, **_describe(folder))
        print(f"{name}: refreshed {figures}", flush=True)
    manifest["total_bytes"] = sum(a["bytes"] for a in manifest["assets"].values())
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def build_assets(out: Path, plan: dict[str, tuple[str, str | None, str]], *, seed: int = 0, quick: bool = False,
                 compile: bool = False, progress: bool = True, corpus: CorpusConfig | None = None,
                 vocab_size: int = 4096) -> tuple[dict, dict]:
    """Train the assets of ``plan`` in order into ``out``; returns (manifest, timing log)."""
    corpus = corpus or CorpusConfig()
    out.mkdir(parents=True, exist_ok=True)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {"assets": {}}
    manifest.update(seed=seed, threads=torch.get_num_threads(), torch=torch.__version__,
                    python=sys.version.split()[0])
    log: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        t0 = time.perf_counter()
        docs = load_documents("train", corpus)
        save_tokenizer(train_tokenizer((d.text for d in docs), TokenizerConfig(vocab_size=vocab_size)), tokenizer_dir)
        print(f"tokenizer: {time.perf_counter() - t0:.1f}s", flush=True)

        for name, (kind, target_name, preset) in plan.items():
            folder = out / name
            if target_name is not None:  # drafts train against it; a draft_model measures its acceptance on it
                target_dir = out / target_name
                if not (target_dir / "config.json").is_file():
                    raise FileNotFoundError(f"{name} needs its target {target_name}; build it first (--only {target_name})")
            if folder.exists():
                shutil.rmtree(folder)
            t0 = time.perf_counter()
            if kind in ("target", "draft_model"):
                result = train_target(TargetTrainConfig(
                    preset=preset, output_dir=str(folder), tokenizer_dir=str(tokenizer_dir), quick=quick,
                    seed=seed, compile=compile and preset == "minimax-m3-tiny", progress=progress, corpus=corpus,
                ))
                summary = {"val_loss": result.val_losses[-1][1] if result.val_losses else None}
            else:
                result = train_draft(DraftTrainConfig(
                    preset=preset, target_dir=str(out / target_name), output_dir=str(folder), quick=quick,
                    seed=seed, progress=progress, corpus=corpus,
                ))
                accept = result.val_acceptance[-1][1] if result.val_acceptance else []
                summary = {"val_greedy_acceptance_k3": [round(a, 4) for a in accept],
                           "val_mean_acceptance_length_k3": round(1 + sum(accept), 4)}
            summary.update(finish_asset(folder, kind, out / target_name if target_name else None))
            elapsed = time.perf_counter() - t0
            log[name] = {"seconds": round(elapsed, 1), "tokens_per_second": round(result.tokens_per_second, 1)}
            manifest["assets"][name] = {"kind": kind, "target": target_name, "preset": preset, "steps": result.steps,
                                        "quick": quick, "num_parameters": result.num_parameters, **summary,
                                        **_describe(folder)}
            print(f"{name}: {result.steps} steps in {elapsed / 60:.1f} min ({result.tokens_per_second:.0f} tok/s) "
                  f"{summary}", flush=True)
    manifest["total_bytes"] = sum(a["bytes"] for a in manifest["assets"].values())
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest, log


def build(args) -> int:
    plan = default_plan()
    names = args.only or list(plan)
    unknown = [n for n in names if n not in plan]
    if unknown:
        print(f"error: unknown assets {unknown}; choose from {list(plan)}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if args.refresh:
        manifest = refresh_assets(Path(args.out), {n: plan[n] for n in names})
        print(f"zoo: {len(names)} assets refreshed, {manifest['total_bytes'] / 1e6:.1f} MB")
        return 0
    try:
        manifest, log = build_assets(Path(args.out), {n: plan[n] for n in names}, seed=args.seed, quick=args.quick,
                                     compile=args.compile, progress=not args.no_progress)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    total = manifest["total_bytes"]
    print(f"zoo: {len(manifest['assets'])} assets, {total / 1e6:.1f} MB (budget {BUDGET_BYTES / 1e6:.0f} MB)")
    if args.log:
        Path(args.log).write_text(json.dumps(log, indent=2) + "\n")
    if total > BUDGET_BYTES:
        print(f"error: the zoo is {total / 1e6:.1f} MB, over the {BUDGET_BYTES / 1e6:.0f} MB budget; "
              "shrink a preset", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ZOO_DIR), help="output folder (default: specdec/zoo)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="each preset's quick schedule (about 1/10)")
    parser.add_argument("--only", action="append", help="build just this asset (repeatable); drafts need their target")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (part of what makes runs identical)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the MiniMax-M3 target's training forward (~1.5x; needs a C++ compiler)")
    parser.add_argument("--log", default=None, help="write per-asset timing to this JSON file")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--refresh", action="store_true",
                        help="no training: re-apply finish_asset (config layouts, target records) to built assets")
    return build(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
