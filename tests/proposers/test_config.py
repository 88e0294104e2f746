import pathlib

import pytest

from specdec.proposers.config import METHODS, SpeculativeConfig, parse_speculative_config


def test_both_public_forms_are_equal():
    a = parse_speculative_config("eagle3:model=/ckpt/draft,num_speculative_tokens=3")
    b = parse_speculative_config('{"method": "eagle3", "model": "/ckpt/draft", "num_speculative_tokens": 3}')
    c = parse_speculative_config({"method": "eagle3", "model": "/ckpt/draft", "num_speculative_tokens": 3})
    assert a == b == c
    assert (a.method, a.model, a.num_speculative_tokens) == ("eagle3", "/ckpt/draft", 3)
    assert parse_speculative_config(a) is a
    assert parse_speculative_config(None) is None


def test_string_values_are_parsed_by_key_type():
    cfg = parse_speculative_config(
        " eagle3-unshifted : model = /d , num_speculative_tokens = 2, kv_sharing=FALSE, block_size=16,"
        "attention_backend=triton")
    assert cfg.kv_sharing is False and cfg.block_size == 16 and cfg.attention_backend == "triton"
    assert cfg.model == "/d" and cfg.num_speculative_tokens == 2


def test_defaults():
    ngram = parse_speculative_config("ngram:num_speculative_tokens=3")
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    only_max = parse_speculative_config("ngram:num_speculative_tokens=3,prompt_lookup_max=2")
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (2, 2)
    only_min = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (4, 4)
    assert parse_speculative_config("eagle3-unshifted:model=m,num_speculative_tokens=1").kv_sharing is True
    assert parse_speculative_config("eagle3:model=m,num_speculative_tokens=1").kv_sharing is None
    # adaptive: off unless asked, a key of every method (the engine reads it).
    assert parse_speculative_config("ngram:num_speculative_tokens=3").adaptive is False
    for method in METHODS:
        keys = {"model": "m"} if method not in ("ngram",) else {}
        assert parse_speculative_config({"method": method, "num_speculative_tokens": 2, "adaptive": True,
                                         **keys}).adaptive is True
    with pytest.raises(ValueError, match="adaptive must be"):
        parse_speculative_config("ngram:num_speculative_tokens=3,adaptive=sometimes")
    # draft_sample_method (vLLM's key): the model-based methods', probabilistic unless asked.
    for method in METHODS:
        keys = {"model": "m"} if method != "ngram" else {}
        cfg = parse_speculative_config({"method": method, "num_speculative_tokens": 2, **keys})
        assert cfg.draft_sample_method == (None if method == "ngram" else "probabilistic")
    greedy = parse_speculative_config("eagle3.1-mla:model=m,num_speculative_tokens=2,draft_sample_method=greedy")
    assert greedy.draft_sample_method == "greedy"


@pytest.mark.parametrize("method", METHODS)
def test_round_trips(method):
    extra = {"ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 4}, "eagle3-unshifted": {"kv_sharing": False}}
    d = {"method": method, "num_speculative_tokens": 4, "block_size": 32, **extra.get(method, {})}
    if method != "ngram":
        d["model"] = "/x/y"
    cfg = SpeculativeConfig.from_dict(d)
    assert SpeculativeConfig.from_string(cfg.to_string()) == cfg
    assert SpeculativeConfig.from_dict(cfg.to_dict()) == cfg


def test_path_model_becomes_a_string():
    cfg = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model=pathlib.Path("/a/b"))
    assert cfg.model == "/a/b"


@pytest.mark.parametrize(
    "value, needles",
    [
        ("medusa:num_speculative_tokens=3", ["unknown method 'medusa'", "eagle3.1-mla", "ngram"]),
        ({"num_speculative_tokens": 3}, ["missing 'method'", "draft_model"]),
        ({"method": "mtp", "num_speculative_tokens": 3}, ["unknown method 'mtp'", "eagle3"]),
        ("eagle3:model=/d", ["requires 'num_speculative_tokens'"]),
        ("draft_model:num_speculative_tokens=3", ["requires 'model'"]),
        ("eagle3.1-mla:num_speculative_tokens=3", ["requires 'model'"]),
        ("ngram:num_speculative_tokens=3,model=/d", ["unknown key 'model'", "prompt_lookup_min"]),
        ("eagle3:model=/d,num_speculative_tokens=3,kv_sharing=true", ["unknown key 'kv_sharing'", "valid keys"]),
        ({"method": "eagle3", "model": "/d", "num_speculative_tokens": 3, "draft_tp": 1}, ["unknown key 'draft_tp'"]),
        ("eagle3:model=/d,num_speculative_tokens=three", ["num_speculative_tokens must be an int"]),
        ("eagle3:model=/d,num_speculative_tokens=0", ["num_speculative_tokens must be an int >= 1"]),
        ({"method": "eagle3", "model": "/d", "num_speculative_tokens": "3"}, ["num_speculative_tokens must be an int"]),
        ({"method": "eagle3", "model": "/d", "num_speculative_tokens": True}, ["num_speculative_tokens must be an int"]),
        ({"method": "eagle3", "model": 5, "num_speculative_tokens": 3}, ["model must be a non-empty string"]),
        ("eagle3-unshifted:model=/d,num_speculative_tokens=3,kv_sharing=yes", ["kv_sharing must be true or false"]),
        ({"method": "eagle3-unshifted", "model": "/d", "num_speculative_tokens": 3, "kv_sharing": 1},
         ["kv_sharing must be true or false"]),
        ("ngram:num_speculative_tokens=3,block_size=-16", ["block_size must be an int >= 1"]),
        ("eagle3:model=/d,num_speculative_tokens=3,draft_sample_method=sampled",
         ["draft_sample_method must be one of 'greedy', 'probabilistic'"]),
        ("ngram:num_speculative_tokens=3,draft_sample_method=greedy", ["unknown key 'draft_sample_method'"]),
        ("ngram:num_speculative_tokens=3,prompt_lookup_min=4,prompt_lookup_max=2", ["prompt_lookup_min (4)"]),
        ("ngram:num_speculative_tokens=3,prompt_lookup_min=0", ["prompt_lookup_min must be an int >= 1"]),
        ("ngram:num_speculative_tokens", ["expected key=value"]),
        ("ngram:num_speculative_tokens=3,num_speculative_tokens=4", ["given twice"]),
        ("{'method': 'ngram'}", ["invalid JSON"]),
        ("[1, 2]", ["unknown method '[1, 2]'"]),
        ("   ", ["empty string"]),
        (3, ["expected None, a string, a dict"]),
    ],
)
def test_errors_name_the_problem_and_the_choices(value, needles):
    with pytest.raises(ValueError) as info:
        parse_speculative_config(value)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match="unknown method"):
        SpeculativeConfig(method="eagle", num_speculative_tokens=3, model="/d")
    with pytest.raises(ValueError, match="not accepted by method 'draft_model'"):
        SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model="/d", prompt_lookup_max=3)
