"""Loading AMD aiter's attention kernels, with or without ROCm.

On a ROCm machine ``import aiter`` works and its native ops are used where they fit. Elsewhere the
package's ``__init__`` fails ("ROCm version file not found", raised while setting up its JIT), yet the
wheel's Triton kernels are plain Python: this module registers empty package modules for ``aiter``,
``aiter.ops`` and ``aiter.ops.triton`` whose ``__path__`` points at the installed folders, so the
kernel modules import without the ROCm-only initialisation, and answers the two device queries
(``get_arch``, ``get_num_sms``) that cannot be asked of a non-AMD device. On the CPU the kernels then
run under Triton's interpreter.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import attrs
import torch

INSTALL_HINT = "pip install specdec[rocm]"

# What aiter's kernels are told they run on when the device cannot say: an MI300X (gfx942, 304 CUs).
STAND_IN_ARCH = "gfx942"
STAND_IN_NUM_CUS = 304

# Launch options only the AMD backend of Triton understands; the CUDA backend rejects unknown ones.
_AMD_ONLY_OPTIONS = ("waves_per_eu", "matrix_instr_nonkdim", "kpack")

_STUB_MARK = "__specdec_stub__"


class AiterUnavailableError(ImportError):
    """amd-aiter is missing or cannot run here; the message is one line naming the fix."""


@attrs.frozen
class AiterKernels:
    """The aiter entry points the backend calls, and how they run."""

    mode: str  # "rocm-native" | "triton-gpu" | "triton-interpreter"
    unified_attention: Callable[..., Any]
    mla_decode: Callable[..., Any]  # aiter.ops.triton.mla_decode_rope.decode_attention_fwd_grouped_rope
    mla_decode_config: dict
    native_mla_decode: Callable[..., Any] | None = None  # aiter.mla.mla_decode_fwd, ROCm only

    def mla_config(self) -> dict:
        # aiter's launcher writes block sizes into the dict it is given; hand it a private copy.
        return copy.deepcopy(self.mla_decode_config)


def aiter_root() -> Path:
    """The installed amd-aiter package folder; one-line :class:`AiterUnavailableError` if absent."""
    module = sys.modules.get("aiter")
    if module is not None and getattr(module, "__path__", None):
        root = Path(list(module.__path__)[0])
    else:
        try:
            spec = importlib.util.find_spec("aiter")
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            raise AiterUnavailableError(f"attention backend 'aiter' needs AMD's amd-aiter package: {INSTALL_HINT}")
        root = Path(list(spec.submodule_search_locations)[0])
    if not (root / "ops" / "triton" / "unified_attention.py").is_file():
        raise AiterUnavailableError(
            f"the installed 'aiter' at {root} is not AMD's amd-aiter (PyPI 'aiter' is an unrelated "
            f"library): pip uninstall aiter && {INSTALL_HINT}"
        )
    return root


def is_rocm() -> bool:
    return torch.version.hip is not None and torch.cuda.is_available()


@functools.lru_cache(maxsize=1)
def load() -> AiterKernels:
    """Import aiter's attention kernels once per process (see the module docstring)."""
    root = aiter_root()
    native_mla = None
    if is_rocm():
        try:
            import aiter  # noqa: F401  (the real package: its __init__ sets up ROCm ops)
            import aiter.mla

            native_mla = aiter.mla.mla_decode_fwd
        except Exception as exc:  # a broken JIT setup must not hide behind the Triton path silently
            warnings.warn(
                f"amd-aiter is installed but `import aiter` failed on this ROCm machine ({exc}); the aiter "
                "backend uses aiter's Triton kernels only",
                RuntimeWarning,
                stacklevel=2,
            )
            _register_stub_packages(root)
    else:
        _register_stub_packages(root)
        if not torch.cuda.is_available() and not _interpreter_on():
            raise AiterUnavailableError(
                "attention backend 'aiter' needs a ROCm GPU; on a CPU set TRITON_INTERPRET=1 before aiter's "
                "kernels are first imported (slow, for tests), or use attention_backend='torch'"
            )
        _answer_device_queries()

    unified = importlib.import_module("aiter.ops.triton.unified_attention")
    mla = importlib.import_module("aiter.ops.triton.mla_decode_rope")
    mla_kernels = importlib.import_module("aiter.ops.triton._triton_kernels.mla_decode_rope")
    if not is_rocm():
        # unified_attention bound get_num_sms by name at import; answer there too.
        unified.get_num_sms = _stand_in_num_sms

    interpreted = type(mla_kernels._fwd_grouped_kernel_stage1_rope).__name__ == "InterpretedFunction"
    if not torch.cuda.is_available() and not interpreted:
        raise AiterUnavailableError(
            "aiter's Triton kernels were imported before TRITON_INTERPRET=1 was set, so they cannot run on "
            "this CPU; set it before the first import of aiter or specdec's aiter backend"
        )
    if torch.cuda.is_available() and not is_rocm() and not interpreted:
        _drop_amd_only_options(unified, ("kernel_unified_attention_2d", "kernel_unified_attention_3d", "reduce_segments"))
        _drop_amd_only_options(mla, ("_fwd_grouped_kernel_stage1_rope", "_fwd_kernel_stage2"))

    mode = "rocm-native" if native_mla is not None else ("triton-interpreter" if interpreted else "triton-gpu")
    return AiterKernels(
        mode=mode,
        unified_attention=unified.unified_attention,
        mla_decode=mla.decode_attention_fwd_grouped_rope,
        mla_decode_config=copy.deepcopy(mla_kernels._get_config()),
        native_mla_decode=native_mla,
    )


def _interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


def _register_stub_packages(root: Path) -> None:
    """Empty ``aiter``, ``aiter.ops``, ``aiter.ops.triton`` packages over the installed folders.

    ``aiter.ops.triton``'s own ``__init__`` is skipped too: it imports quantisation kernels the
    attention kernels do not need.
    """
    folders = {"aiter": root, "aiter.ops": root / "ops", "aiter.ops.triton": root / "ops" / "triton"}
    for name, folder in folders.items():
        existing = sys.modules.get(name)
        if existing is not None:
            if not getattr(existing, "__path__", None):
                raise AiterUnavailableError(f"sys.modules[{name!r}] is not a package; cannot load aiter's kernels")
            continue
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(folder)]
        module = importlib.util.module_from_spec(spec)
        module.__doc__ = f"Stand-in for {name} registered by specdec so aiter's Triton kernels import without ROCm."
        setattr(module, _STUB_MARK, True)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)


def _stand_in_num_sms() -> int:
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return STAND_IN_NUM_CUS


def _answer_device_queries() -> None:
    arch_info = importlib.import_module("aiter.ops.triton.utils._triton.arch_info")
    device_info = importlib.import_module("aiter.ops.triton.utils.device_info")
    arch_info.get_arch = lambda: STAND_IN_ARCH
    device_info.get_num_sms = _stand_in_num_sms


class _PortableLaunch:
    """``kernel[grid](...)`` minus the AMD-only launch options, for aiter's kernels on NVIDIA GPUs."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            for option in _AMD_ONLY_OPTIONS:
                kwargs.pop(option, None)
            return launch(*args, **kwargs)

        return run


def _drop_amd_only_options(module, names) -> None:
    for name in names:
        kernel = getattr(module, name)
        if not isinstance(kernel, _PortableLaunch):
            setattr(module, name, _PortableLaunch(kernel))
