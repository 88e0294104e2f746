"""The ``LLM`` facade: sampling reproducibility, text prompts, stops, limits and errors."""

from __future__ import annotations

import pytest

from specdec import LLM, RequestOutput, SamplingParams

PROMPTS = [[1, 2, 3], [5] * 9, [7, 8, 9, 10, 11, 12, 13], [100], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def llm(llama):
    return LLM(llama, dtype="float64", block_size=4, kv_cache_memory=1 << 22)


def _sampled(max_tokens=12, seed=None, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.9, top_k=50, seed=seed, ignore_eos=True, **kw)


def test_seeded_request_is_independent_of_its_batch(llama, llm):
    alone = llm.generate([PROMPTS[2]], _sampled(seed=1234), use_tqdm=False)[0].token_ids
    others = [_sampled(), SamplingParams(max_tokens=5), _sampled(seed=1234), _sampled(max_tokens=30), _sampled(seed=9)]
    batched = llm.generate(PROMPTS, others, use_tqdm=False)
    assert batched[2].token_ids == alone
    # Different row order and a tiny budget that forces preemption: still the same tokens.
    small = LLM(llama, dtype="float64", block_size=4, kv_cache_memory=_bytes_per_token(llm) * 48)
    reordered = small.generate(PROMPTS[::-1], others[::-1], use_tqdm=False)
    assert small.engine.stats.num_preemptions > 0
    assert reordered[2].token_ids == alone
    # The seed matters: another one gives another continuation.
    assert llm.generate([PROMPTS[2]], _sampled(seed=1235), use_tqdm=False)[0].token_ids != alone


def test_unseeded_requests_follow_the_llm_seed(llama):
    runs = []
    for seed in (0, 0, 1):
        llm = LLM(llama, dtype="float64", kv_cache_memory=1 << 22, seed=seed)
        runs.append([o.token_ids for o in llm.generate(PROMPTS, _sampled(max_tokens=16), use_tqdm=False)])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    # Requests of one run do not share random numbers: the same prompt twice differs.
    llm = LLM(llama, dtype="float64", kv_cache_memory=1 << 22)
    twins = llm.generate([PROMPTS[0], PROMPTS[0]], _sampled(max_tokens=16), use_tqdm=False)
    assert twins[0].token_ids != twins[1].token_ids


def test_greedy_is_the_argmax_path(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=10), use_tqdm=False)
    again = llm.generate(PROMPTS[::-1], SamplingParams(max_tokens=10), use_tqdm=False)[::-1]
    assert [o.token_ids for o in greedy] == [o.token_ids for o in again]
    assert all(isinstance(o, RequestOutput) and o.text is not None for o in greedy)


def test_text_prompts_are_encoded_and_outputs_decoded(llm):
    out = llm.generate(["def hello ( x ) :"], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.tokenizer
    assert out.prompt_token_ids == tok("def hello ( x ) :")["input_ids"]
    assert out.prompt_token_ids[0] == 1  # the tokenizer's BOS
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert out.text.split() == [tok.convert_ids_to_tokens(t) for t in out.token_ids if t > 2]


def test_stop_token_ids_eos_and_ignore_eos(llm):
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20, stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    # The tiny llama emits EOS (id 2) early for this prompt: generation ends there unless told not to.
    assert 2 in free.token_ids
    with_eos = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=20), use_tqdm=False)[0]
    assert with_eos.token_ids == free.token_ids[: free.token_ids.index(2) + 1]
    assert with_eos.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 20


def test_max_model_len_caps_generation(llama):
    llm = LLM(llama, dtype="float64", kv_cache_memory=1 << 22, max_model_len=10)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 13))], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLM(llama, max_model_len=10_000)


def test_request_too_large_fails_up_front_naming_kv_cache_memory(llm, llama):
    small = LLM(llama, dtype="float64", block_size=4, kv_cache_memory=_bytes_per_token(llm) * 40)
    params = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=200)]
    with pytest.raises(ValueError, match="kv_cache_memory"):
        small.generate([[1, 2, 3], [4, 5, 6]], params, use_tqdm=False)
    # Nothing was queued by the failed call: the engine serves the next call normally.
    assert not small.engine.has_unfinished()
    ok = small.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(ok[0].token_ids) == 8


def test_bad_inputs_are_clear_errors(llm, tiny_checkpoint):
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 999]], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate([[1], [2]], [SamplingParams()] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="not a single string"):
        llm.generate("hello", use_tqdm=False)
    no_tokenizer = LLM(str(tiny_checkpoint("qwen3")), kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="no tokenizer"):
        no_tokenizer.generate(["hello"], use_tqdm=False)
    assert no_tokenizer.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)[0].text is None
    with pytest.raises(ValueError, match="unknown attention backend"):
        LLM(str(tiny_checkpoint("qwen3")), attention_backend="nope")
    with pytest.raises(ValueError, match="kv_cache_memory"):
        LLM(str(tiny_checkpoint("qwen3")), kv_cache_memory=0)
    with pytest.raises(ValueError, match="does not exist"):
        LLM("/nonexistent/model/folder")


def test_spec_stats_is_none_without_speculation(llm):
    assert llm.spec_stats() is None
    llm.reset_spec_stats()  # harmless


def test_default_kv_cache_memory_fits_max_num_seqs_full_requests(llama):
    llm = LLM(llama, dtype="float64", max_num_seqs=4)
    cache = llm.engine.cache
    assert cache.memory_budget == _bytes_per_token(llm) * 4 * llm.max_model_len
    assert cache.capacity()["target"] >= 4 * llm.max_model_len - cache.pool("target").block_size


def _bytes_per_token(llm: LLM) -> int:
    return sum(p.bytes_per_token() for p in llm.engine.cache.pools.values())


def test_progress_bar_on_request_and_off_by_default_when_not_a_terminal(llm, capsys):
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2), use_tqdm=True)
    assert "2/2" in capsys.readouterr().err
    llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2))  # stderr is not a tty under pytest
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------- stop strings and logprobs
ZOO_PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n"]
SPECS = [None, "ngram:num_speculative_tokens=3,prompt_lookup_min=1,prompt_lookup_max=3",
         "eagle3:model={zoo}/llama-tiny-eagle3,num_speculative_tokens=3"]


@pytest.fixture(scope="module")
def zoo_llama():
    from specdec.zoo import zoo_path

    return str(zoo_path("llama-tiny"))


def test_stop_strings_end_the_text_at_the_same_token_with_and_without_speculation(zoo_llama):
    from specdec.zoo import zoo_path

    params = SamplingParams(max_tokens=48, stop=["\n\n", " of the list", "sys\nimport"])
    runs = []
    for spec in SPECS:
        spec = spec.format(zoo=zoo_path("llama-tiny").parent) if spec else None
        llm = LLM(zoo_llama, dtype="float64", kv_cache_memory=1 << 24, speculative_config=spec)
        runs.append(llm.generate(ZOO_PROMPTS, params, use_tqdm=False))
    free = LLM(zoo_llama, dtype="float64", kv_cache_memory=1 << 24).generate(
        ZOO_PROMPTS, SamplingParams(max_tokens=48), use_tqdm=False)
    tok = LLM(zoo_llama, kv_cache_memory=1 << 22).tokenizer
    for plain, unstopped in zip(runs[0], free):
        cut = min(i for i in (unstopped.text.find(s) for s in params.stop) if i >= 0)
        assert plain.finish_reason == "stop" and plain.text == unstopped.text[:cut]
        assert plain.token_ids == unstopped.token_ids[: len(plain.token_ids)]
        assert plain.text == tok.decode(plain.token_ids)[:cut]  # the tokens up to the one completing the stop
    for other in runs[1:]:
        assert [(o.token_ids, o.text, o.finish_reason) for o in other] == \
               [(o.token_ids, o.text, o.finish_reason) for o in runs[0]]


def test_logprobs_are_the_models_and_equal_with_speculation(llama):
    import torch
    from transformers import AutoModelForCausalLM

    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    plain = LLM(llama, dtype="float64", kv_cache_memory=1 << 22).generate(PROMPTS[:3], params, use_tqdm=False)
    spec = LLM(llama, dtype="float64", kv_cache_memory=1 << 22,
               speculative_config="ngram:num_speculative_tokens=3,prompt_lookup_min=1,prompt_lookup_max=2")
    spec_out = spec.generate(PROMPTS[:3], params, use_tqdm=False)
    assert spec.spec_stats().num_accepted_tokens > 0
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float64)
    for a, b, prompt in zip(plain, spec_out, PROMPTS):
        assert a.token_ids == b.token_ids
        ids = prompt + a.token_ids
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
        got = [(lp.token_id, lp.logprob, lp.top) for lp in (*a.prompt_logprobs, *a.logprobs)]
        assert [t for t, _, _ in got] == ids[1:]
        for pos, (token, logprob, top) in enumerate(got):
            # transformers computes norms and RoPE in float32 even in a float64 model (FACTS.md 7).
            assert logprob == pytest.approx(float(want[pos, token]), abs=1e-6)
            assert [t for t, _ in top] == want[pos].topk(len(top)).indices.tolist() and len(top) == (
                2 if pos < len(prompt) - 1 else 3)
        for x, y in zip((*a.prompt_logprobs, *a.logprobs), (*b.prompt_logprobs, *b.logprobs)):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-12)
    assert LLM(llama, dtype="float64", kv_cache_memory=1 << 22).generate(
        [[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)[0].logprobs is None


def test_stop_strings_need_a_tokenizer(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama_draft")), dtype="float64", kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="stop strings, but the model folder has no tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop="x"), use_tqdm=False)
