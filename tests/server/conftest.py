"""Fixtures of the server tests: the zoo's llama-tiny, served without and with its EAGLE3 draft."""

from __future__ import annotations

import pytest
from live_server import MEMORY, LiveServer, eagle3_spec

from specdec.zoo import zoo_path


@pytest.fixture(scope="session")
def llama() -> str:
    """The zoo's llama-tiny (its tokenizer carries a chat template, as every zoo target's does)."""
    return str(zoo_path("llama-tiny"))


@pytest.fixture(scope="module")
def plain_server(llama):
    with LiveServer(llama, "--dtype", "float64", "--kv-cache-memory", MEMORY) as server:
        yield server


@pytest.fixture(scope="module")
def spec_server(llama):
    with LiveServer(llama, "--dtype", "float64", "--kv-cache-memory", MEMORY,
                    "--speculative-config", eagle3_spec()) as server:
        yield server
