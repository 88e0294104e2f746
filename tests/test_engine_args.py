"""``EngineArgs``: one declaration of the engine options, validated once, feeding ``LLM`` and the CLI."""

from __future__ import annotations

import argparse

import attrs
import pytest

from specdec.bench.config import BenchConfig
from specdec.cli import build_parser
from specdec.engine_args import EngineArgs, add_cli_args, cli_values, flag_name


@pytest.mark.parametrize(
    "field, value, needle",
    [
        ("block_size", 0, "block_size must be an int >= 1 or None, got 0"),
        ("kv_cache_memory", True, "kv_cache_memory must be an int >= 1 or None, got True"),
        ("max_num_seqs", 1.5, "max_num_seqs must be an int >= 1, got 1.5"),
        ("max_model_len", 1, "max_model_len must be an int >= 2 or None, got 1"),
        ("seed", "0", "seed must be an int, got '0'"),
        ("dtype", "int3", "unknown dtype 'int3'; choose one of"),
        ("attention_backend", "", "attention_backend must be a non-empty string"),
        ("speculative_config", "medusa:num_speculative_tokens=2", "unknown method 'medusa'"),
    ],
)
def test_each_option_is_validated_at_construction(field, value, needle):
    with pytest.raises(ValueError) as info:
        EngineArgs(model="/m", **{field: value})
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_unknown_llm_arguments_list_the_valid_ones():
    with pytest.raises(ValueError, match="LLM got an unknown argument 'gpu_memory_utilization'; valid: model, "):
        EngineArgs.from_kwargs("LLM", model="/m", gpu_memory_utilization=0.9)


def test_the_speculative_config_is_parsed_once():
    args = EngineArgs(model="/m", speculative_config="ngram:num_speculative_tokens=2")
    assert args.speculative_config.method == "ngram" and args.speculative_config.prompt_lookup_max == 5


@pytest.mark.parametrize("command, config", [("generate", EngineArgs), ("bench", BenchConfig)])
def test_every_field_is_a_flag_and_only_given_flags_are_read(command, config, capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--help"])
    helped = capsys.readouterr().out
    for field in attrs.fields(config):
        assert flag_name(field.name) in helped
    argv = [command, "--model", "/m", "--kv-cache-memory", "2M", "--max-num-seqs", "3"]
    if command == "generate":
        argv += ["--prompt", "x"]
    given = cli_values(parser.parse_args(argv), config)
    assert given == {"model": "/m", "kv_cache_memory": 2 << 20, "max_num_seqs": 3}
    assert config(**given).attention_backend == "torch"  # the class's default, not the parser's


def test_flags_are_generated_for_any_config_class():
    @attrs.frozen(kw_only=True)
    class Opts:
        depth: int = attrs.field(default=2, metadata={"help": "how deep", "parse": int, "flag": True})
        hidden: int = attrs.field(default=0)

    parser = argparse.ArgumentParser()
    add_cli_args(parser, Opts)
    assert cli_values(parser.parse_args(["--depth", "5"]), Opts) == {"depth": 5}
    assert cli_values(parser.parse_args([]), Opts) == {}
    with pytest.raises(SystemExit):
        parser.parse_args(["--hidden", "1"])
