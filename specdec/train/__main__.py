"""``python -m specdec.train {corpus,tokenizer,target,draft,measure,measure-draft,presets}``: see each --help."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_corpus(args) -> int:
    from specdec.train.corpus import CorpusConfig, corpus_fingerprint, load_documents

    config = CorpusConfig(validation_fraction=args.validation_fraction)
    for split in ("train", "validation"):
        docs = load_documents(split, config)
        chars = sum(len(d.text) for d in docs)
        print(f"{split:10s} {len(docs):5d} documents {chars / 1e6:7.2f} M chars  fingerprint {corpus_fingerprint(docs)}")
    return 0


def _cmd_tokenizer(args) -> int:
    from specdec.train.corpus import load_documents
    from specdec.train.tokenizer import TokenizerConfig, save_tokenizer, train_tokenizer

    tok = train_tokenizer((d.text for d in load_documents("train")), TokenizerConfig(vocab_size=args.vocab_size))
    save_tokenizer(tok, args.out)
    print(f"saved a {len(tok)}-token tokenizer to {args.out}")
    return 0


def _cmd_target(args) -> int:
    from specdec.train.target import TargetTrainConfig, train_target

    config = TargetTrainConfig(
        preset=args.preset,
        output_dir=args.out,
        tokenizer_dir=args.tokenizer,
        steps=args.steps,
        quick=args.quick,
        seed=args.seed,
        threads=args.threads,
        compile=args.compile,
        progress=not args.no_progress,
    )
    result = train_target(config)
    last_val = result.val_losses[-1][1] if result.val_losses else float("nan")
    print(
        f"saved {args.preset} ({result.num_parameters / 1e6:.2f}M params) to {result.output_dir}: "
        f"{result.steps} steps, val loss {last_val:.3f}, {result.tokens_per_second:.0f} tok/s"
    )
    return 0


def _cmd_draft(args) -> int:
    from specdec.train.draft import DraftTrainConfig, train_draft

    config = DraftTrainConfig(
        preset=args.preset,
        target_dir=args.target,
        output_dir=args.out,
        steps=args.steps,
        quick=args.quick,
        seed=args.seed,
        threads=args.threads,
        progress=not args.no_progress,
    )
    result = train_draft(config)
    agreement = "/".join(f"{a:.2f}" for a in result.val_accuracy[-1][1]) if result.val_accuracy else "-"
    accept = result.val_acceptance[-1][1] if result.val_acceptance else []
    print(
        f"saved {args.preset} ({result.num_parameters / 1e6:.2f}M params) to {result.output_dir}: "
        f"{result.steps} steps, val top-1 agreement per step {agreement}; greedy k=3 acceptance on the target's "
        f"own text {'/'.join(f'{a:.2f}' for a in accept)} (mean length {1 + sum(accept):.2f}), "
        f"{result.tokens_per_second:.0f} tok/s"
    )
    return 0


def _cmd_measure_draft(args) -> int:
    from specdec.train.draft import get_draft_preset, measure_draft_throughput

    for name in args.preset:
        preset = get_draft_preset(name)
        target = args.target or _default_target(name)
        print(json.dumps(measure_draft_throughput(preset, target, steps=args.steps, threads=args.threads)), flush=True)
    return 0


def _default_target(draft_name: str) -> str:
    from specdec.train.presets import PRESETS

    for name in sorted(PRESETS, key=len, reverse=True):
        if draft_name.startswith(name + "-"):
            return name
    raise ValueError(f"cannot tell the target preset of draft {draft_name!r}; pass --target PRESET")


def _cmd_measure(args) -> int:
    from specdec.train.presets import PRESETS
    from specdec.train.target import measure_throughput

    names = args.preset or list(PRESETS)
    for name in names:
        result = measure_throughput(name, steps=args.steps, threads=args.threads, compile=args.compile)
        print(json.dumps(result), flush=True)
    return 0


def _cmd_presets(args) -> int:
    from specdec.train.presets import PRESETS

    from specdec.train.draft import DRAFT_PRESETS

    for name, preset in PRESETS.items():
        print(f"{name:28s} {preset.model_type:20s} steps {preset.steps:5d} (quick {preset.quick_steps:4d})  "
              f"{preset.description}")
    for name, draft in DRAFT_PRESETS.items():
        kind = "eagle3-" + draft.attention + ("-unshifted" if draft.unshifted else "")
        print(f"{name:28s} {kind:20s} steps {draft.steps:5d} (quick {draft.quick_steps:4d})  {draft.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specdec.train", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("corpus", help="print the offline corpus' document counts and fingerprints")
    p.add_argument("--validation-fraction", type=float, default=0.05)
    p.set_defaults(func=_cmd_corpus)

    p = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer and save it")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.set_defaults(func=_cmd_tokenizer)

    p = sub.add_parser("target", help="train a target LM preset and save the checkpoint folder")
    p.add_argument("--preset", required=True, help="preset name (see `presets`)")
    p.add_argument("--out", required=True, help="output checkpoint folder")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: train one on the corpus)")
    p.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    p.add_argument("--quick", action="store_true", help="about a tenth of the full schedule")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument("--compile", action="store_true", help="torch.compile the training forward (~1.5x)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_target)

    p = sub.add_parser("draft", help="train an EAGLE3 draft preset against a trained target folder")
    p.add_argument("--preset", required=True, help="draft preset name (see `presets`)")
    p.add_argument("--target", required=True, help="trained target checkpoint folder (with its tokenizer)")
    p.add_argument("--out", required=True, help="output draft folder")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_cmd_draft)

    p = sub.add_parser("measure-draft", help="measure draft training tokens/s against a random target")
    p.add_argument("--preset", action="append", required=True, help="draft preset name (repeatable)")
    p.add_argument("--target", default=None, help="target preset (default: from the draft's name)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(func=_cmd_measure_draft)

    p = sub.add_parser("measure", help="measure training tokens/s of presets on random tokens")
    p.add_argument("--preset", action="append", help="preset name (repeatable; default: all zoo presets)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--compile", action="store_true")
    p.set_defaults(func=_cmd_measure)

    p = sub.add_parser("presets", help="list the presets")
    p.set_defaults(func=_cmd_presets)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
