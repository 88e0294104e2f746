"""The bundled zoo: what ``manifest.json`` records is what is on disk, and every pair is lossless.

Each built asset's files must hash as the manifest says (a stale manifest, or weights edited by
hand, fail here), stay under the repository's 20 MB per-file limit and, all together, the 60 MB
budget. Every draft loads against its target and speculates losslessly in float64 (bf16 weights
widen exactly), with the acceptance of a trained draft, not a random one, and never warns (at load,
or from the acceptance alarm over enough drafts to have named a collapse).
"""

from __future__ import annotations

import hashlib
import json

import pytest

from specdec import LLM, SamplingParams
from specdec.engine.acceptance_alarm import AcceptanceAlarm, DraftExpectation
from specdec.train.corpus import validation_prompts
from specdec.zoo import ASSETS, BUDGET_BYTES, MAX_FILE_BYTES, ZOO_DIR, available

MANIFEST = json.loads((ZOO_DIR / "manifest.json").read_text())
BUILT = available()
# An asset's kind is the speculative method it serves (eagle3, eagle3.1-mla, eagle3-unshifted, draft_model).
DRAFTS = [name for name in BUILT if ASSETS[name][0] != "target" and ASSETS[name][1] in BUILT]


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_demo_pair_is_built():
    # examples/run_minimax_m3.py runs out of the box on these two.
    assert {"minimax-m3-tiny", "minimax-m3-tiny-eagle3"} <= set(BUILT)


@pytest.mark.parametrize("name", BUILT)
def test_manifest_matches_the_files(name):
    entry = MANIFEST["assets"][name]
    folder = ZOO_DIR / name
    on_disk = sorted(p.name for p in folder.iterdir() if p.is_file())
    assert on_disk == sorted(entry["files"]), "files differ from manifest.json; rebuild with scripts/build_zoo.py"
    for file_name, recorded in entry["files"].items():
        path = folder / file_name
        assert path.stat().st_size == recorded["bytes"] <= MAX_FILE_BYTES, file_name
        assert _sha256(path) == recorded["sha256"], f"{name}/{file_name} does not match manifest.json"


@pytest.mark.parametrize("name", [n for n in BUILT if ASSETS[n][0] == "target"])
def test_every_target_tokenizer_has_a_chat_template(name):
    """The server's /v1/chat/completions renders conversations through it."""
    from specdec.train.tokenizer import BOS_ID, load_tokenizer
    from specdec.zoo import zoo_path

    tokenizer = load_tokenizer(zoo_path(name))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "def f():"}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    text = tokenizer.decode(ids)
    assert ids[0] == BOS_ID and text.startswith("<s>user: def f():") and text.endswith("<s>assistant:")


def test_the_zoo_fits_its_budget():
    total = sum(MANIFEST["assets"][name]["bytes"] for name in BUILT)
    assert total == MANIFEST["total_bytes"] and total < BUDGET_BYTES


@pytest.mark.parametrize("name", DRAFTS)
def test_every_draft_is_lossless_on_its_target_accepts_and_never_warns(name):
    method, target_name = ASSETS[name]
    target = str(ZOO_DIR / target_name)
    prompts = validation_prompts(target, 12, 24)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    common = dict(dtype="float64", max_num_seqs=12, kv_cache_memory=64 << 20)
    plain = [o.token_ids for o in LLM(target, **common).generate(prompts, params, use_tqdm=False)]
    spec = {"method": method, "model": str(ZOO_DIR / name), "num_speculative_tokens": 3}
    llm = LLM(target, speculative_config=spec, **common)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == plain
    stats = llm.spec_stats()
    # A trained draft is right well beyond chance (1 in a few thousand) on its first guess.
    assert stats.acceptance_per_position[0] > 0.2
    # Nothing suspicious at load, and no alarm over more drafts than a collapse would have needed.
    horizon = AcceptanceAlarm(DraftExpectation.for_draft(method, ZOO_DIR / name)).collapse_horizon
    assert stats.warnings == [] and stats.num_drafts >= horizon
