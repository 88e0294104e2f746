"""``specdec bench``'s workloads (specdec/bench/workload.py): shared-prefix and multi-turn requests,
what they find in the prefix cache, and where the prompts come from (held-out text by default,
synthetic ids on request). The zoo's llama-tiny gives a real tokenizer."""

from __future__ import annotations

import json

import pytest

from specdec import LLM, SamplingParams
from specdec.bench import BenchConfig, load_workload, serve
from specdec.bench.workload import COPY_PIECE, HELD_OUT, SYNTHETIC
from specdec.cli import main
from specdec.tokenizer import load_tokenizer
from specdec.train.corpus import iter_documents, split_of
from specdec.zoo import zoo_path

NGRAM = "ngram:num_speculative_tokens=3,prompt_lookup_min=1,prompt_lookup_max=2"


# ----------------------------------------------------------------------------- workloads and the prefix cache
ZOO_LLAMA = str(zoo_path("llama-tiny"))  # real tokenizer: the workloads' prompts are held-out text
PREFIX, SUFFIX = 32, 8  # two 16-token pages of system prompt


def test_shared_prefix_requests_share_their_system_prompt_and_nothing_else():
    config = BenchConfig(model=ZOO_LLAMA, workload="shared-prefix", num_prompts=6, num_prefixes=2, prefix_len=PREFIX,
                         input_len=SUFFIX, warmup=1)
    w = load_workload(config)
    assert w.source == HELD_OUT and w.messages == [] and len(w.prompts) == 6
    assert all(len(p) == PREFIX + SUFFIX for p in w.prompts) and w.prompt_lengths() == [PREFIX + SUFFIX] * 6
    systems = [p[:PREFIX] for p in w.prompts]
    assert systems[0] != systems[1] and all(systems[i] == systems[i % 2] for i in range(6))
    assert len({tuple(p[PREFIX:]) for p in w.prompts}) == 6  # every user suffix its own
    # The warm-up request shares no page with the run's prompts.
    assert len(w.warmup) == 1 and all(w.warmup[0][:16] != p[:16] for p in w.prompts)


def test_multi_turn_prompts_extend_the_previous_turn_and_its_output():
    config = BenchConfig(model=ZOO_LLAMA, workload="multi-turn", num_prompts=3, num_turns=3, input_len=6, output_len=4,
                         warmup=0)
    w = load_workload(config)
    assert w.source == HELD_OUT and [len(m) for m in w.messages] == [2, 2, 2]
    llm = LLM(ZOO_LLAMA, dtype="float64", kv_cache_memory=4 << 20)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sent = []

    def follow_up(c, turn, prompt, output):
        nxt = w.follow_up(c, turn, prompt, output)
        sent.append((c, turn, list(prompt), list(output), nxt))
        return nxt

    records, _, _, outputs = serve(llm.engine, w.prompts, params, 2, follow_up=follow_up)
    assert [r.prompt_len for r in records] == w.prompt_lengths() == [6, 16, 26] * 3  # conversation by conversation
    for c in range(3):
        turns = [x for x in sent if x[0] == c]
        assert [x[1] for x in turns] == [0, 1, 2]
        prompt = w.prompts[c]
        for _, turn, got, output, nxt in turns:
            assert got == prompt and output == outputs[3 * c + turn]
            prompt = nxt
            assert nxt == (got + output + w.messages[c][turn] if turn < 2 else None)
        mine = records[3 * c : 3 * c + 3]  # each turn arrives once the previous one's last token is out
        assert all(b.arrival >= a.emissions[-1][0] for a, b in zip(mine, mine[1:]))
    # The engine ran those prompts: the last turns' outputs are what LLM.generate gives for them.
    last = [x[2] for x in sent if x[1] == 2]
    assert [o.token_ids for o in llm.generate(last, params, use_tqdm=False)] == outputs[2::3]


@pytest.mark.parametrize("workload, extra, hits", [
    # Requests 0 and 1 start together; 2..5 each find their system prompt's two pages.
    ("shared-prefix", ["--num-prompts", "6", "--num-prefixes", "2", "--prefix-len", str(PREFIX),
                       "--input-len", str(SUFFIX), "--concurrency", "2"], 4 * PREFIX),
    # Turn 2 finds the page of turn 1's 16-token message (turn 1 computed 16 + 3 positions: one full page).
    ("multi-turn", ["--num-prompts", "2", "--num-turns", "2", "--input-len", "16", "--concurrency", "2",
                    "--speculative-config", NGRAM], 2 * 16),
])
def test_workloads_hit_the_prefix_cache_only_with_caching_on(workload, extra, hits, capsys):
    common = ["bench", "--model", ZOO_LLAMA, "--dtype", "float64", "--kv-cache-memory", "4M", "--output-len", "4",
              "--workload", workload, *extra]
    capsys.readouterr()
    assert main([*common, "--json"]) == 0
    on = json.loads(capsys.readouterr().out)
    runs = [r for r in (on["baseline"], on["speculative"]) if r is not None]
    queries = sum(r["prompt_len"] for r in on["baseline"]["requests"])
    for run in runs:
        assert run["prefix_cache"] == {"queries": queries, "hits": hits, "hit_rate": hits / queries}
    assert on["settings"]["prompt_source"] == HELD_OUT and on["settings"]["workload"] == workload
    if on["speculative"] is not None:
        assert on["identical_outputs"] == on["settings"]["num_prompts"]  # lossless, whole conversations included
    assert main([*common, "--no-enable-prefix-caching"]) == 0
    table = capsys.readouterr().out
    assert HELD_OUT in table.splitlines()[0]
    assert f"0/{queries} (0.0%)" in next(line for line in table.splitlines() if line.startswith("no "))


# ----------------------------------------------------------------------------- prompt sources
def test_default_prompts_are_held_out_text_spread_over_the_held_out_files():
    config = BenchConfig(model=ZOO_LLAMA, num_prompts=16, input_len=64, warmup=1)
    w = load_workload(config)
    assert w.source == HELD_OUT and len(w.prompts) == 16 and len(w.warmup) == 1
    assert load_workload(config).prompts == w.prompts  # deterministic
    tokenizer = load_tokenizer(ZOO_LLAMA)
    # What scripts/build_zoo.py trained every zoo model on: the corpus's train split (its defaults).
    train, held_out = [], []
    for doc in iter_documents("all"):
        if split_of(doc.name, 0.05) == "train":
            train.append(doc.text)
        elif doc.name.startswith("stdlib/"):
            held_out.append(doc)
    training_text = "\0".join(train)
    files = set()
    for prompt in w.prompts + w.warmup:
        assert len(prompt) == 64 and not set(prompt) & set(tokenizer.all_special_ids)
        text = tokenizer.decode(prompt)
        assert text not in training_text
        for piece in range(0, 64, COPY_PIECE):
            assert tokenizer.decode(prompt[piece : piece + COPY_PIECE]) not in training_text
        head = tokenizer.decode(prompt[:16])
        files |= {doc.name for doc in held_out if head in doc.text}
    assert len(files) >= 10  # spread over the held-out files, not cut from the first one


def test_synthetic_prompts_on_request():
    w = load_workload(BenchConfig(model=ZOO_LLAMA, prompt_source="synthetic", num_prompts=3, input_len=8, warmup=0))
    special = set(load_tokenizer(ZOO_LLAMA).all_special_ids)
    assert w.source == SYNTHETIC and [len(p) for p in w.prompts] == [8] * 3
    assert all(0 <= t < 4096 and t not in special for p in w.prompts for t in p)
    shared = load_workload(BenchConfig(model=ZOO_LLAMA, prompt_source="synthetic", workload="shared-prefix",
                                       num_prompts=2, num_prefixes=1, prefix_len=8, input_len=4, warmup=0))
    assert shared.source == SYNTHETIC and shared.prompts[0][:8] == shared.prompts[1][:8]
