"""End to end through ``LLM``: the triton and aiter backends generate what the torch backend does.

Greedy generation, token for token, on tiny llama and deepseek_v3 targets: without speculation, and
with EAGLE3 drafts (an MHA draft under both, the ``eagle3.1-mla`` draft living in the deepseek
target's MLA pool), the draft also on another backend than the target. Speculation is lossless, so
equal outputs alone would not show a broken draft backend: every step's drafts and accepted counts
(the engine's trace) must be equal too. The drafts follow nearly-bigram targets (eagle3_oracle.py),
so some drafts are accepted and catch-up and verify rows vary.

Triton runs in float64 against torch in float64; aiter's kernels take no float64, so aiter runs and
their torch baselines are float32.

Page sizes: pools are independent, so targets and drafts at different page sizes (MLA page 1 with
an MHA draft at 16, 64 with 16, MiniMax-M3's 128 with 16) must run and give the plain run's tokens,
and a combination no page size can serve fails in one line from ``LLM`` and from the CLI.

Small on purpose (two prompts, a few tokens, 32-wide models): Triton's interpreter runs the kernels.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.backends import get_backend
from specdec.backends.torch_ref import TorchBackend
from specdec.cache.pool import AttentionPool, MLAPool
from specdec.cli import main
from specdec.outputs import trace_entries
from specdec.engine.compat import (
    BackendFeatureError,
    PageSizeError,
    PoolUse,
    check_engine_pools,
    describe_support,
)

# The EAGLE3 checkpoint writers live beside the proposer tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "proposers"))
from eagle3_oracle import (  # noqa: E402
    save_deepseek_target,
    save_llama_target,
    save_minimax_m3_target,
    write_oracle_draft,
)
from eagle3_reference import DraftSpec  # noqa: E402

PROMPTS = [[3, 17, 5, 9, 41, 2, 33, 8, 12], [7, 1, 60, 22, 22]]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
K = 3
MEMORY = 1 << 22
# aiter takes no float64; triton is checked where rounding cannot excuse a difference.
DTYPE = {"triton": "float64", "aiter": "float32"}
AUX = (0, 1, 2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Oracle targets and EAGLE3 drafts: ``llama`` / ``deepseek`` / ``m3`` and their drafts."""
    root = tmp_path_factory.mktemp("backends_e2e")
    paths = {
        "llama": save_llama_target(root / "llama", num_layers=3),
        "deepseek": save_deepseek_target(root / "deepseek"),
    }
    # mix: the draft's KV depends on the hidden states fed, so a wrong draft attention shows.
    drafts = {
        "llama-mha": ("llama", DraftSpec(layout="sglang", kv_heads=4, aux_ids=AUX, draft_vocab=48)),
        "deepseek-mha": ("deepseek", DraftSpec(layout="vllm", kv_heads=4, aux_ids=AUX, draft_vocab=48)),
        "deepseek-mla": ("deepseek", DraftSpec(layout="mla", kv_lora_rank=64, aux_ids=AUX, fc_norm=True,
                                               own_lm_head=False)),
    }
    for name, (target, spec) in drafts.items():
        write_oracle_draft(root / name, spec, paths[target], mix=0.5)
        paths[name] = root / name
    return {k: str(v) for k, v in paths.items()}


def generate(model, backend="torch", dtype="float64", draft=None, method="eagle3", draft_backend=None,
             block_size=None, draft_block_size=None):
    """Outputs, trace (drafts and accepted counts per step and request) and pool layout of one run."""
    spec = None
    if draft is not None:
        spec = {"method": method, "model": draft, "num_speculative_tokens": K}
        if draft_backend:
            spec["attention_backend"] = draft_backend
        if draft_block_size:
            spec["block_size"] = draft_block_size
    llm = LLM(model, speculative_config=spec, attention_backend=backend, dtype=dtype, block_size=block_size,
              kv_cache_memory=MEMORY)
    steps = []
    outputs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, on_step=steps.append)]
    trace = [(e["step"], e["request"], e["draft_token_ids"], e["num_accepted"]) for e in trace_entries(steps)]
    pools = {name: (p.kind, p.block_size, p.num_layers) for name, p in llm.engine.cache.pools.items()}
    return outputs, trace, pools


@pytest.fixture(scope="module")
def torch_run():
    """``generate`` on the torch backend, memoised: the baselines several cases share."""
    runs = {}

    def get(model, dtype, **kwargs):
        key = (model, dtype, tuple(sorted(kwargs.items())))
        if key not in runs:
            runs[key] = generate(model, "torch", dtype, **kwargs)
        return runs[key]

    return get


# ----------------------------------------------------------------------------- backends vs torch
@pytest.mark.parametrize("backend", ["triton", "aiter"])
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3"])
def test_plain_greedy_equals_torch(arch, backend, tiny_checkpoint, torch_run):
    model, dtype = str(tiny_checkpoint(arch)), DTYPE[backend]
    # Triton runs any page size: 4-token pages there, the torch baseline at its default 16.
    outputs, _, pools = generate(model, backend, dtype, block_size=4 if backend == "triton" else None)
    assert outputs == torch_run(model, dtype)[0]
    assert pools["target"][1] == (4 if backend == "triton" else 16)


# (target, draft, method, target backend, draft backend or None for the target's)
EAGLE_CASES = [
    ("llama", "llama-mha", "eagle3", "triton", None),
    ("llama", "llama-mha", "eagle3", "aiter", None),
    ("llama", "llama-mha", "eagle3", "triton", "aiter"),
    ("deepseek", "deepseek-mha", "eagle3", "triton", None),
    ("deepseek", "deepseek-mha", "eagle3", "aiter", None),
    ("deepseek", "deepseek-mha", "eagle3", "torch", "aiter"),
    ("deepseek", "deepseek-mla", "eagle3.1-mla", "triton", None),
    ("deepseek", "deepseek-mla", "eagle3.1-mla", "aiter", None),
    # One MLA pool, two backends: the target's layers on torch, the draft's on triton.
    ("deepseek", "deepseek-mla", "eagle3.1-mla", "torch", "triton"),
]


@pytest.mark.parametrize(
    "target,draft,method,backend,draft_backend",
    EAGLE_CASES,
    ids=[f"{d}-{m}-{b}" + (f"-draft-{db}" if db else "") for _, d, m, b, db in EAGLE_CASES],
)
def test_eagle3_greedy_and_drafts_equal_torch(target, draft, method, backend, draft_backend, ckpt, torch_run):
    dtype = "float32" if "aiter" in (backend, draft_backend) else "float64"
    outputs, trace, pools = generate(ckpt[target], backend, dtype, ckpt[draft], method, draft_backend)
    expected_outputs, expected_trace, expected_pools = torch_run(ckpt[target], dtype, draft=ckpt[draft], method=method)
    assert outputs == expected_outputs
    assert trace == expected_trace
    assert pools == expected_pools
    # The case is only worth its time if drafts were made, and some accepted.
    assert trace and sum(accepted for *_, accepted in trace) > 0
    if method == "eagle3.1-mla":
        assert list(pools) == ["target"]  # the draft is one more layer of the target's MLA pool


# ----------------------------------------------------------------------------- page sizes
class Mla16Backend(TorchBackend):
    """The torch backend under a native paged-MLA kernel's page rule: MLA pages in multiples of 16.

    No built-in backend refuses any MLA page size (aiter addresses MLA per token), but native kernels
    do (FlashMLA: 64); this is how a combination with no common page size arises.
    """

    name = "torch-mla16"

    def supports_block_size(self, block_size: int, pool_kind: str) -> bool:
        if pool_kind == "mla":
            return block_size >= 16 and block_size % 16 == 0
        return super().supports_block_size(block_size, pool_kind)


@pytest.fixture
def mla16():
    from specdec.backends import BACKENDS, register_backend

    register_backend(Mla16Backend.name, Mla16Backend)
    yield Mla16Backend.name
    BACKENDS.unregister(Mla16Backend.name)


def _one_line(message: str) -> str:
    assert "\n" not in message.strip(), message
    return message


@pytest.mark.parametrize(
    "block_size,draft_backend,draft_block_size,dtype",
    [(1, "aiter", None, "float32"), (64, None, 16, "float64"), (1, None, 3, "float64")],
    ids=["mla-page1+mha-aiter-16", "mla-page64+mha-16", "mla-page1+mha-3"],
)
def test_target_and_draft_pools_keep_their_own_page_sizes(block_size, draft_backend, draft_block_size, dtype, ckpt,
                                                          torch_run):
    outputs, trace, pools = generate(ckpt["deepseek"], "torch", dtype, ckpt["deepseek-mha"],
                                     draft_backend=draft_backend, block_size=block_size,
                                     draft_block_size=draft_block_size)
    assert pools == {"target": ("mla", block_size, 3), "draft": ("attention", draft_block_size or 16, 1)}
    assert outputs == torch_run(ckpt["deepseek"], dtype)[0]
    # Page sizes change no arithmetic: the drafts are those of the default layout.
    assert trace == torch_run(ckpt["deepseek"], dtype, draft=ckpt["deepseek-mha"])[1]


def test_minimax_m3_128_token_pages_with_a_16_token_aiter_draft(tmp_path, torch_run):
    target = save_minimax_m3_target(tmp_path / "m3")
    write_oracle_draft(tmp_path / "draft", DraftSpec(layout="vllm", kv_heads=4, aux_ids=AUX), target, mix=0.5)
    outputs, trace, pools = generate(str(target), "torch", "float32", str(tmp_path / "draft"), draft_backend="aiter")
    assert pools["target"][:2] == ("attention", 128) and pools["draft"] == ("attention", 16, 1)
    assert outputs == torch_run(str(target), "float32")[0]
    assert trace == torch_run(str(target), "float32", draft=str(tmp_path / "draft"))[1]


def test_minimax_m3_target_on_aiter_is_refused_when_the_engine_is_built(tmp_path, capsys):
    # aiter's attention takes no per-query block mask, which MiniMax-M3's sparse layers need.
    target = str(save_minimax_m3_target(tmp_path / "m3"))
    with pytest.raises(BackendFeatureError) as err:
        LLM(target, attention_backend="aiter", kv_cache_memory=MEMORY)
    message = _one_line(str(err.value))
    assert "custom_mask" in message and "'aiter'" in message and "attention_backend='torch' or 'triton'" in message
    capsys.readouterr()  # drop the checkpoint writer's progress output
    code = main(["generate", "--model", target, "--attention-backend", "aiter", "--kv-cache-memory", "4M",
                 "--prompt-ids", "1,2,3"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and captured.err.strip().splitlines() == [f"error: {message}"]


def test_no_common_page_size_fails_in_one_line_from_llm_and_cli(ckpt, mla16, torch_run, capsys):
    spec = {"method": "eagle3.1-mla", "model": ckpt["deepseek-mla"], "num_speculative_tokens": K,
            "attention_backend": mla16}
    with pytest.raises(PageSizeError) as err:
        LLM(ckpt["deepseek"], speculative_config=spec, block_size=1, kv_cache_memory=MEMORY)
    message = _one_line(str(err.value))
    assert message.startswith(
        "target pool 'target' (mla, page 1, backend torch) cannot host the draft layer: draft backend "
        "'torch-mla16' supports mla pages of 16, 32, 64, 128, 256, 512"
    )
    assert "set the target's block_size to 16" in message
    assert "leave the speculative config's attention_backend unset" in message

    config = f"eagle3.1-mla:model={ckpt['deepseek-mla']},num_speculative_tokens={K},attention_backend={mla16}"
    code = main(["generate", "--model", ckpt["deepseek"], "--block-size", "1", "--kv-cache-memory", "4M",
                 "--speculative-config", config, "--prompt-ids", "1,2,3"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.strip().splitlines() == [f"error: {message}"]

    # The first way out the message gives works, and is lossless.
    outputs, trace, pools = generate(ckpt["deepseek"], "torch", "float64", ckpt["deepseek-mla"], "eagle3.1-mla",
                                     mla16, block_size=16)
    assert pools == {"target": ("mla", 16, 4)}
    assert (outputs, trace) == torch_run(ckpt["deepseek"], "float64", draft=ckpt["deepseek-mla"],
                                         method="eagle3.1-mla")[:2]


def test_eagle3_mla_draft_takes_its_own_pool_when_the_targets_pages_do_not_suit_its_backend(ckpt, mla16, torch_run):
    # Method eagle3 may give the MLA draft a pool of its own, so this combination can work and must.
    outputs, trace, pools = generate(ckpt["deepseek"], "torch", "float64", ckpt["deepseek-mla"], "eagle3", mla16,
                                     block_size=1)
    assert pools == {"target": ("mla", 1, 3), "draft": ("mla", 16, 1)}
    assert outputs == torch_run(ckpt["deepseek"], "float64")[0]
    assert trace == torch_run(ckpt["deepseek"], "float64", draft=ckpt["deepseek-mla"], method="eagle3.1-mla")[1]


def test_builtin_backends_refuse_unsupported_pages_in_one_line(tiny_checkpoint, ckpt, capsys):
    llama = str(tiny_checkpoint("llama"))
    with pytest.raises(PageSizeError) as err:
        LLM(llama, attention_backend="aiter", block_size=1, kv_cache_memory=MEMORY)
    assert "aiter" in _one_line(str(err.value)) and "attention pages of 16, 32" in str(err.value)
    config = f"eagle3:model={ckpt['deepseek-mha']},num_speculative_tokens=2,attention_backend=aiter,block_size=8"
    for argv in (
        ["--attention-backend", "aiter", "--block-size", "1", "--model", llama],
        ["--model", ckpt["deepseek"], "--block-size", "1", "--speculative-config", config],
    ):
        code = main(["generate", *argv, "--kv-cache-memory", "4M", "--prompt-ids", "1,2,3"])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1
        assert lines[0].startswith("error: attention backend 'aiter' does not support")
    assert "speculative config block_size=8" in lines[0] and "attention pages of 16, 32" in lines[0]


# ----------------------------------------------------------------------------- the check itself
def test_backends_describe_their_page_sizes():
    assert describe_support(TorchBackend(), "mla") == "any mla page size"
    aiter = get_backend("aiter")
    assert describe_support(aiter, "attention") == (
        "attention pages of 16, 32, 64, 128, 256, 512 (of the powers of two up to 512)"
    )
    assert describe_support(aiter, "mla") == "any mla page size"
    assert describe_support(get_backend("triton"), "attention") == "any attention page size"


def test_check_names_both_sides_for_every_use():
    torch_backend, aiter = TorchBackend(), get_backend("aiter")

    def attention_pool(name, page):
        return AttentionPool(name, num_layers=1, block_size=page, num_kv_heads=2, head_dim=8, dtype=torch.float32)

    target = attention_pool("target", 1)
    # KV sharing: a draft reading the target's 1-token pages on aiter, which needs multiples of 16.
    with pytest.raises(PageSizeError) as err:
        check_engine_pools([target], torch_backend, [PoolUse(target, "draft", aiter, "read")])
    assert _one_line(str(err.value)).startswith(
        "target pool 'target' (attention, page 1, backend torch) cannot be read by the draft (KV sharing): "
        "draft backend 'aiter' supports attention pages of 16"
    )
    assert "set the target's block_size to 16 (or 32, 64, 128, 256, 512)" in str(err.value)
    # MiniMax-M3-like targets fix their page size: no block_size to suggest, only the backend.
    with pytest.raises(PageSizeError) as err:
        check_engine_pools([target], torch_backend, [PoolUse(target, "draft", aiter, "read")], required_block_size=1)
    assert "block_size" not in str(err.value) and "run the draft on the target's backend" in str(err.value)
    # A draft pool its own backend cannot run (whatever registered it).
    draft = attention_pool("draft", 8)
    with pytest.raises(PageSizeError, match=r"^draft pool 'draft' \(attention, page 8\) cannot run on the draft "
                                            r"backend 'aiter', which supports attention pages of 16.*; set the "
                                            r"speculative config's block_size to 16"):
        check_engine_pools([target], torch_backend, [PoolUse(draft, "draft", aiter, "own")])
    # Independent pools at different page sizes are fine; so is a 16-page MLA pool shared with aiter.
    shared = MLAPool("target", num_layers=2, block_size=16, kv_lora_rank=16, qk_rope_head_dim=8, dtype=torch.float32)
    check_engine_pools([shared], torch_backend, [PoolUse(shared, "draft", aiter, "host"),
                                                 PoolUse(attention_pool("draft", 16), "draft", aiter, "own")])
