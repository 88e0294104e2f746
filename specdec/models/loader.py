"""Load Hugging Face checkpoint folders (config.json + safetensors) into specdec models."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from transformers import CONFIG_MAPPING, AutoConfig

from specdec.models.layers import prepack_weights
from specdec.models.registry import model_class, supported_model_types

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class CheckpointError(ValueError):
    """A folder is not a loadable checkpoint, or its tensors do not fit the architecture."""


def resolve_dtype(dtype: str | torch.dtype, hf_config) -> torch.dtype:
    """``"auto"`` takes the checkpoint's own dtype (float32 when it records none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        recorded = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(recorded, torch.dtype):
            return recorded
        return _DTYPES.get(str(recorded).replace("torch.", ""), torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {['auto', *_DTYPES]}")
    return _DTYPES[dtype]


def read_config_json(path: str | Path) -> dict:
    """The raw ``config.json`` of a checkpoint folder, with a clear error if the folder is not one."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {str(path)!r} does not exist")
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{str(path)!r} is not a checkpoint folder: it has no config.json")
    try:
        raw = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{str(folder / 'config.json')!r} is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{str(folder / 'config.json')!r} must hold a JSON object")
    return raw


# model_types whose config.json only loads through remote code, mapped to the transformers config
# class of the same architecture (Kimi-K2.x is a DeepSeek-V3 architecture).
_CONFIG_FALLBACKS = {"kimi_k2": "deepseek_v3"}


def load_config(path: str | Path):
    """The transformers config of a checkpoint folder (offline), with a clear error if it is not one.

    Remote code is never run: configs transformers cannot read natively fail, except the
    ``_CONFIG_FALLBACKS`` types, read with the transformers config class of their architecture (they
    keep their own ``model_type``).
    """
    folder = Path(path)
    raw = read_config_json(folder)
    try:
        fallback = _CONFIG_FALLBACKS.get(raw.get("model_type"))
        if fallback is not None:
            return CONFIG_MAPPING[fallback].from_dict(raw)
        return AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, TypeError) as err:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        raise CheckpointError(f"cannot read the config of {str(path)!r} (model_type {model_type!r}): {err}") from None


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files of a folder: the index's shards, or ``model.safetensors``, or every ``*.safetensors``."""
    folder = Path(path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(f"{str(path)!r}: shards listed in {index.name} are missing: {missing}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{str(path)!r} holds no *.safetensors weights")
    return files


def iter_safetensors(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one tensor at a time, so loading never holds two copies of the weights."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# vLLM's fp8 checkpoints: ``model.layers.N.self_attn.k_scale`` / ``v_scale`` (one float each; MLA keeps
# its latent's under ``k_scale``), or one ``kv_scale`` for both.
_KV_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn(?:\.attn)?\.(k_scale|v_scale|kv_scale)$")


def _without_kv_scales(weights, scales: dict[int, dict[str, float]]):
    """``weights`` less the KV-cache scales, which go to ``scales[layer]["k" | "v"]`` instead."""
    for name, tensor in weights:
        match = _KV_SCALE.search(name)
        if match is None:
            yield name, tensor
            continue
        layer, kind, value = int(match.group(1)), match.group(2), float(tensor.float().max())
        for entry in ("k", "v") if kind == "kv_scale" else (kind[0],):
            scales.setdefault(layer, {})[entry] = value


def load_model(path: str | Path, *, dtype: str | torch.dtype = "auto", device: str | torch.device = "cpu"):
    """Build the specdec model for a checkpoint folder and load its weights.

    The model is created on the meta device, given uninitialised storage on ``device``, then filled
    tensor by tensor from the safetensors files, and made ready to serve
    (:func:`specdec.models.layers.prepack_weights`: prepack again after changing its weights).
    """
    # Check the architecture before transformers parses the config, so an unknown model_type gets
    # specdec's list of supported ones rather than transformers' "does not recognize" message.
    model_type = read_config_json(path).get("model_type")
    if model_type not in supported_model_types():
        raise CheckpointError(
            f"{str(path)!r} has unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
        )
    hf_config = load_config(path)
    cls = model_class(hf_config)
    torch_dtype = resolve_dtype(dtype, hf_config)
    with torch.device("meta"):
        model = cls(hf_config)
    model.to_empty(device=device)
    model.to(torch_dtype)
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    kv_scales: dict[int, dict[str, float]] = {}
    model.load_weights(_without_kv_scales(iter_safetensors(path), kv_scales))
    model.kv_scales = kv_scales  # fp8 KV pools read them (specdec.engine.pools)
    # Inference only: without grad tracking, outputs of inference_mode forwards can feed later ops.
    model.requires_grad_(False)
    model.eval()
    prepack_weights(model)
    return model


def apply_kv_scales(model, pools) -> None:
    """Give the fp8 ones of ``model``'s registered ``pools`` the checkpoint's per-layer KV scales
    (``model.kv_scales``, read by :func:`load_model`); a layer without one keeps 1.0, as in vLLM. An MLA
    latent takes its layer's ``k`` scale."""
    scales = getattr(model, "kv_scales", None) or {}
    quantized = {pool.name: pool for pool in pools if pool.quantized}
    if not scales or not quantized:
        return
    for model_layer, (pool_name, layer) in enumerate(model.kv_layer_slots()):
        pool = quantized.get(pool_name)
        for entry, value in scales.get(model_layer, {}).items() if pool is not None else ():
            pool.set_scale(layer, "latent" if pool.kind == "mla" else entry, value)
