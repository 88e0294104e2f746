"""The bundled tiny model zoo: trained offline by ``scripts/build_zoo.py``, shipped in bf16.

Each asset is an ordinary checkpoint folder next to this file; :func:`zoo_path` finds one by name.

Targets (transformers checkpoints with the shared 4096-token BPE tokenizer):
``minimax-m3-tiny`` (MiniMax-M3 shape, 128-token KV pages), ``kimi-k2-tiny`` (deepseek_v3 / MLA),
``llama-tiny``, and ``draft-model-tiny`` (a small independent LM for the ``draft_model`` method).

Drafts (EAGLE3 ``layers.0.*`` layout; ``config.json`` names the target's aux layers):
``minimax-m3-tiny-eagle3``, ``kimi-k2-tiny-eagle3.1-mla`` (method ``eagle3.1-mla``),
``kimi-k2-tiny-eagle3``, ``llama-tiny-eagle3`` and ``llama-tiny-eagle3-unshifted`` (method
``eagle3-unshifted``; trained to read the target's last-layer KV at prompt positions).
"""

from __future__ import annotations

from pathlib import Path

ZOO_DIR = Path(__file__).resolve().parent
# Issue 9's budget for every bundled asset together, and the repository's limit per file.
BUDGET_BYTES = 60_000_000
MAX_FILE_BYTES = 20_000_000

# name -> (kind, target asset for drafts)
ASSETS: dict[str, tuple[str, str | None]] = {
    "minimax-m3-tiny": ("target", None),
    "kimi-k2-tiny": ("target", None),
    "llama-tiny": ("target", None),
    "draft-model-tiny": ("draft_model", "llama-tiny"),
    "minimax-m3-tiny-eagle3": ("eagle3", "minimax-m3-tiny"),
    "kimi-k2-tiny-eagle3.1-mla": ("eagle3.1-mla", "kimi-k2-tiny"),
    "kimi-k2-tiny-eagle3": ("eagle3", "kimi-k2-tiny"),
    "llama-tiny-eagle3": ("eagle3", "llama-tiny"),
    "llama-tiny-eagle3-unshifted": ("eagle3-unshifted", "llama-tiny"),
}


def zoo_path(name: str) -> Path:
    """The folder of bundled asset ``name``; a clear error when the name is unknown or it is not built."""
    if name not in ASSETS:
        raise ValueError(f"unknown zoo asset {name!r}; choose one of {sorted(ASSETS)}")
    folder = ZOO_DIR / name
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise FileNotFoundError(
            f"zoo asset {name!r} is not built in {str(folder)!r}; run `python scripts/build_zoo.py` "
            f"(or `--only {name}`)"
        )
    return folder


def available() -> list[str]:
    """The names of the assets that are built."""
    out = []
    for name in ASSETS:
        try:
            zoo_path(name)
        except FileNotFoundError:
            continue
        out.append(name)
    return out
