"""EAGLE3 draft training: training-time test equals serving, training learns, checkpoints load."""

from __future__ import annotations

import json

import attrs
import pytest
import torch
from safetensors import safe_open

from specdec.backends import get_backend
from specdec.cache import PagedKVCache
from specdec.runtime.model_runner import Chunk, ModelRunner
from specdec.models import load_model
from specdec.proposers.eagle3 import load_eagle3_draft
from specdec.train.draft import (
    DraftPreset,
    DraftTrainConfig,
    HFTarget,
    build_draft,
    draft_config_dict,
    get_draft_preset,
    resolve_aux_layer_ids,
    resolve_kv_sharing_layer,
    save_draft,
    train_draft,
    ttt_forward,
)
from specdec.train.presets import get_preset
from specdec.train.target import TargetTrainConfig, train_target
from specdec.train.ttt import TTTContext
from specdec.train.vocab import frequency_vocab

VOCAB = 64
SEQ = 12


def _random_target(folder, preset_name: str):
    """A float64 transformers target with random, spread-out weights (so drafts see varied states)."""
    torch.manual_seed(0)
    config = get_preset(preset_name).hf_config(VOCAB)
    config.initializer_range = 0.2
    from transformers import AutoModelForCausalLM

    kwargs = {"experts_implementation": "eager"} if config.model_type != "llama" else {}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, **kwargs)
    model.save_pretrained(str(folder))
    return folder


def _paged_log_probs(draft, aux_row, tokens, preset, anchor, steps, shared=None, split=0):
    """The served draft, step by step over its own paged pool, from ``anchor`` (float64)."""
    cache = PagedKVCache(1 << 22)
    pools = [cache.register(p) for p in draft.kv_pools("draft", 4, torch.float64)]
    cache.build()
    runner = ModelRunner(draft, cache, get_backend("torch"), [p.name for p in pools])
    off = 0 if preset.unshifted else 1
    hidden_all = draft.combine_aux(aux_row)
    if preset.unshifted:
        hidden_all = torch.cat([torch.zeros_like(hidden_all[:1]), hidden_all[:-1]])
    if split:
        # The prompt: the draft computes nothing there, its pool holds the target layer's K/V.
        ctx, _ = runner.prepare([Chunk(0, tokens[:split])])
        k, v = shared
        ctx.backend.write_kv(ctx.cache.pool("draft").layer(0), {"k": k[:split], "v": v[:split]},
                             ctx.metadata["draft"].slot_mapping)
    ids = tokens[split + off : anchor + off + 1]
    ctx, positions = runner.prepare([Chunk(0, ids)])
    post, nxt = draft(torch.tensor(ids), positions, hidden_all[split : anchor + 1], ctx)
    out = [torch.log_softmax(draft.compute_logits(post[-1:]), -1)[0]]
    for j in range(1, steps):
        ids = [tokens[anchor + off + j]]
        ctx, positions = runner.prepare([Chunk(0, ids)])
        post, nxt = draft(torch.tensor(ids), positions, nxt[-1:], ctx)
        out.append(torch.log_softmax(draft.compute_logits(post), -1)[0])
    return out


CASES = [
    ("test-llama", DraftPreset(name="mha", attention="mha", intermediate_size=48, aux_layer_ids=(0, 1),
                               draft_vocab_size=40, own_lm_head=True, ttt_steps=4, seq_len=SEQ)),
    ("test-llama", DraftPreset(name="mha-shared-head", attention="mha", intermediate_size=48, aux_layer_ids=(0, 1),
                               draft_vocab_size=40, ttt_steps=4, seq_len=SEQ, eagle31=True)),
    ("test-kimi-k2", DraftPreset(name="mla", attention="mla", intermediate_size=48, aux_layer_ids=(0, 1),
                                 eagle31=True, ttt_steps=4, seq_len=SEQ)),
    ("test-llama", DraftPreset(name="unshifted", attention="mha", intermediate_size=48, aux_layer_ids=(0, 1),
                               unshifted=True, ttt_steps=4, seq_len=SEQ)),
    ("test-llama", DraftPreset(name="unshifted-kv", attention="mha", intermediate_size=48, aux_layer_ids=(0, 1),
                               unshifted=True, kv_sharing=True, ttt_steps=4, seq_len=SEQ)),
]


@pytest.mark.parametrize("target_preset, preset", CASES, ids=[c[1].name for c in CASES])
def test_training_time_test_equals_serving_step_by_step(tmp_path, target_preset, preset):
    """Every TTT step at every anchor is what the served draft computes over the paged cache."""
    folder = _random_target(tmp_path / "target", target_preset)
    target = HFTarget(folder, autocast=False, dtype=torch.float64)
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(3, VOCAB, (2, SEQ), generator=generator)
    vocab = frequency_vocab(batch, VOCAB, preset.draft_vocab_size, always=(2,))
    aux_ids = resolve_aux_layer_ids(preset, target)
    kv_layer = None
    if preset.kv_sharing:
        kv_layer = resolve_kv_sharing_layer(preset, target, *target.layer_kv_layouts()[0][1:3])
        assert kv_layer == target.num_layers - 1  # the last matching layer by default
    config = draft_config_dict(preset, target, vocab, aux_ids, kv_layer)
    draft = build_draft(config, aux_ids, target, vocab, preset.own_lm_head, seed=0).double()
    split = torch.tensor([3, 5]) if preset.kv_sharing else None
    with torch.no_grad():
        ttt = ttt_forward(draft, target, batch, preset, vocab, kv_layer, split, autocast=False, keep_log_probs=True)
        aux, _, kv = target.run(batch, aux_ids, kv_layer)

    save_draft(draft, config, vocab, tmp_path / "draft", dtype=torch.float64)
    served_target = load_model(folder, dtype="float64")
    method = "eagle3.1-mla" if preset.attention == "mla" else "eagle3"
    served = load_eagle3_draft(tmp_path / "draft", served_target, dtype="float64", method=method)
    assert served.aux_layer_ids == aux_ids and served.norm_output == preset.eagle31
    off = 0 if preset.unshifted else 1
    checked = 0
    with torch.no_grad():
        for row in range(batch.shape[0]):
            s = int(split[row]) if split is not None else 0
            shared = (kv[0][row].transpose(0, 1), kv[1][row].transpose(0, 1)) if kv is not None else None
            for anchor in range(s, SEQ - off):
                steps = min(preset.ttt_steps, SEQ - off - anchor)
                paged = _paged_log_probs(served, aux[row], batch[row].tolist(), preset, anchor, steps, shared, s)
                for j, got in enumerate(paged):
                    want = ttt.step_log_probs[j][row, anchor]
                    assert torch.allclose(got, want, atol=1e-9, rtol=0), (row, anchor, j, float((got - want).abs().max()))
                    checked += 1
    assert checked > 20


def test_greedy_replay_moves_like_the_engine():
    from specdec.train.draft import replay_greedy_acceptance

    # One window, shifted (offset 1), k = 2. hits[j][0, p]: step j from anchor p is right.
    step0 = torch.tensor([[1, 0, 1, 1, 1, 0, 0, 0, 0, 0]], dtype=torch.bool)
    step1 = torch.tensor([[1, 1, 0, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    accepted, drafts = replay_greedy_acceptance([step0, step1], first_anchor=0, k=2, offset=1)
    # anchor 0: accepts 2 -> anchor 3: accepts 2 -> anchor 6: 0 -> anchor 7: 0; anchor 8 has no room.
    assert (accepted, drafts) == ([2, 2], 4)
    accepted, drafts = replay_greedy_acceptance([step0, step1], first_anchor=1, k=2, offset=1)
    # anchor 1: 0 -> 2: 1 -> 4: 1 -> 6: 0 -> 7: 0
    assert (accepted, drafts) == ([2, 0], 5)


def test_ttt_context_rejects_misuse():
    with pytest.raises(ValueError, match="go together"):
        TTTContext(1, 4, shared_kv=(torch.zeros(1),), split=None)
    ctx = TTTContext(1, 4)
    q = torch.randn(4, 2, 8)
    kv = torch.randn(4, 1, 8)
    ctx.attend("p", 0, q, kv, kv, scale=0.3)
    ctx.next_step()
    ctx.attend("p", 0, q, kv, kv, scale=0.3)
    with pytest.raises(RuntimeError, match="twice in step"):
        ctx.attend("p", 0, q, kv, kv, scale=0.3)
    with pytest.raises(ValueError, match="sliding-window"):
        TTTContext(1, 4).attend("p", 0, q, kv, kv, scale=0.3, sliding_window=2)


def test_frequency_vocab_keeps_the_most_frequent_and_eos():
    stream = torch.tensor([5] * 10 + [7] * 5 + [3] * 5 + [9])
    vocab = frequency_vocab(stream, 12, 3, always=(2,))
    assert vocab.target_ids.tolist() == [2, 3, 5]  # ties go to the lower id; EOS always in
    assert vocab.d2t.tolist() == [2, 2, 3]
    assert vocab.t2d.nonzero().flatten().tolist() == [2, 3, 5]
    full = frequency_vocab(stream, 12, None)
    assert full.is_full and not full.d2t.any()
    with pytest.raises(ValueError, match="draft_vocab_size"):
        frequency_vocab(stream, 12, 13)


def test_bad_draft_presets_are_refused():
    with pytest.raises(ValueError, match="needs unshifted"):
        DraftPreset(name="x", attention="mha", intermediate_size=8, kv_sharing=True)
    with pytest.raises(ValueError, match="takes its heads from the target"):
        DraftPreset(name="x", attention="mla", intermediate_size=8, num_attention_heads=2)
    with pytest.raises(ValueError, match="unknown draft preset"):
        get_draft_preset("nope")


# ----------------------------------------------------------------------------- real (short) training


@pytest.fixture(scope="module")
def trained_targets(tmp_path_factory, small_corpus, small_tokenizer_dir):
    root = tmp_path_factory.mktemp("draft_targets")
    out = {}
    for name in ("test-llama", "test-kimi-k2"):
        config = TargetTrainConfig(preset=name, output_dir=str(root / name), tokenizer_dir=str(small_tokenizer_dir),
                                   corpus=small_corpus, progress=False, steps=80)
        out[name] = train_target(config).output_dir
    return out


@pytest.mark.parametrize("target_name, draft_name", [
    ("test-llama", "test-eagle3"),
    ("test-kimi-k2", "test-eagle3.1-mla"),
    ("test-llama", "test-eagle3-unshifted"),
])
def test_draft_training_learns_and_saves_a_loadable_layers0_checkpoint(
        tmp_path, small_corpus, trained_targets, target_name, draft_name):
    preset = get_draft_preset(draft_name)
    result = train_draft(DraftTrainConfig(preset=preset, target_dir=str(trained_targets[target_name]),
                                          output_dir=str(tmp_path / draft_name), corpus=small_corpus,
                                          progress=False, eval_every=10))
    losses = result.train_losses
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5
    last = result.val_accuracy[-1][1]
    assert len(last) == preset.ttt_steps and last[0] > 0.1  # chance is 1/400
    accept = result.val_acceptance[-1][1]  # greedy k=3 replayed on the target's own greedy text
    assert len(accept) == min(3, preset.ttt_steps) and 0.0 < accept[0] <= 1.0
    assert all(a >= b for a, b in zip(accept, accept[1:]))

    folder = result.output_dir
    config = json.loads((folder / "config.json").read_text())
    eagle = config["eagle_config"]
    assert eagle["eagle_aux_hidden_state_layer_ids"] == list(preset.aux_layer_ids)
    assert eagle["fc_norm"] is preset.eagle31 and eagle["norm_output"] is preset.eagle31
    assert config["num_hidden_layers"] == 1 and config["dtype"] == "bfloat16"
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names and all(n.startswith(("layers.0.", "fc", "norm", "lm_head", "d2t", "t2d")) for n in names)
    assert "embed_tokens.weight" not in names  # shares the target's
    assert ("d2t" in names) == (preset.draft_vocab_size is not None)
    assert ("lm_head.weight" in names) == preset.own_lm_head
    if preset.unshifted:
        assert eagle["unshifted"] is True and eagle["bootstrap_hidden"] == "zeros"
        assert eagle["kv_sharing_target_layers"] == {"0": 1}  # test-llama has 2 layers

    target = load_model(trained_targets[target_name])
    method = "eagle3.1-mla" if preset.attention == "mla" else "eagle3"
    draft = load_eagle3_draft(folder, target, method=method)
    assert draft.draft_vocab_size == (preset.draft_vocab_size or target.vocab_size)
    meta = json.loads((folder / "training.json").read_text())
    assert meta["steps"] == preset.steps and len(meta["val_top1_agreement_per_step"]) >= 2
    assert meta["val_mean_acceptance_length_k3"] == pytest.approx(1 + sum(accept[:3]))


def test_same_seed_same_draft(tmp_path, small_corpus, trained_targets):
    def weights(sub):
        result = train_draft(DraftTrainConfig(preset="test-eagle3", target_dir=str(trained_targets["test-llama"]),
                                              output_dir=str(tmp_path / sub), corpus=small_corpus, progress=False,
                                              steps=3))
        with safe_open(str(result.output_dir / "model.safetensors"), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    a, b = weights("a"), weights("b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_preset_checks_against_the_target(tmp_path):
    folder = _random_target(tmp_path / "t", "test-llama")
    target = HFTarget(folder)
    bad_ids = DraftPreset(name="x", attention="mha", intermediate_size=8, aux_layer_ids=(0, 5))
    with pytest.raises(ValueError, match="within 0..1"):
        resolve_aux_layer_ids(bad_ids, target)
    with pytest.raises(ValueError, match="default aux ids"):
        resolve_aux_layer_ids(DraftPreset(name="x", attention="mha", intermediate_size=8), target)
    sharing = DraftPreset(name="x", attention="mha", intermediate_size=8, unshifted=True, kv_sharing=True,
                          kv_sharing_layer=0)
    with pytest.raises(ValueError, match="KV layout"):
        resolve_kv_sharing_layer(sharing, target, kv_heads=3, head_dim=16)
    mla = DraftPreset(name="x", attention="mla", intermediate_size=8, aux_layer_ids=(0, 1))
    with pytest.raises(ValueError, match="needs an MLA target"):
        draft_config_dict(mla, target, frequency_vocab(torch.arange(VOCAB), VOCAB, None), (0, 1), None)
    assert attrs.evolve(sharing, kv_sharing_layer=None).kv_sharing


def test_target_generation_is_its_own_greedy_text(tmp_path):
    folder = _random_target(tmp_path / "t", "test-llama")
    target = HFTarget(folder, autocast=False, dtype=torch.float64)
    prompts = torch.randint(3, VOCAB, (3, 4), generator=torch.Generator().manual_seed(0))
    text = target.generate(prompts, 10, batch_size=2)
    assert text.shape == (3, 10) and torch.equal(text[:, :4], prompts)
    _, logits, _ = target.run(text, (0,))
    assert torch.equal(logits.argmax(-1)[:, 3:9], text[:, 4:10])


def test_self_distillation_mixes_generated_windows(tmp_path, small_corpus, trained_targets):
    preset = attrs.evolve(get_draft_preset("test-eagle3"), generated_windows=6, generated_fraction=0.5, steps=4,
                          quick_steps=4)
    assert preset.generated_per_batch == 2
    result = train_draft(DraftTrainConfig(preset=preset, target_dir=str(trained_targets["test-llama"]),
                                          output_dir=str(tmp_path / "d"), corpus=small_corpus, progress=False))
    meta = json.loads((result.output_dir / "training.json").read_text())
    assert meta["generated_windows"] == 6 and result.steps == 4
    with pytest.raises(ValueError, match="prompt_len"):
        attrs.evolve(preset, prompt_len=preset.seq_len)
