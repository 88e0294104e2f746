"""Every built-in proposer implements every member of the ``Proposer`` protocol (a conformance check
that fails when one lacks a member), and ``ProposerBase`` gives a plug-in all the optional ones."""

from __future__ import annotations

import pytest

from specdec.proposers import Proposal, ProposerBase
from specdec.proposers.base import Proposer, ProposerPools
from specdec.proposers.config import METHODS, parse_speculative_config
from specdec.proposers.registry import create_proposer

MEMBERS = sorted({*Proposer.__annotations__, *(n for n in vars(Proposer) if not n.startswith("_"))})


def _missing(obj) -> list[str]:
    return [name for name in MEMBERS if not hasattr(obj, name)]


def test_the_protocol_names_what_the_engine_uses():
    assert MEMBERS == ["aux_layer_ids", "num_speculative_tokens", "on_step", "propose", "setup"]


@pytest.mark.parametrize("method", METHODS)
def test_every_built_in_conforms(method):
    config = {"method": method, "num_speculative_tokens": 2}
    if method != "ngram":
        config["model"] = "/not/loaded/until/setup"
    proposer = create_proposer(parse_speculative_config(config))
    assert _missing(proposer) == [] and isinstance(proposer, Proposer)
    assert proposer.num_speculative_tokens == 2


def test_the_smallest_plugin_conforms_and_a_broken_one_does_not():
    class Smallest(ProposerBase):
        def __init__(self, num_speculative_tokens: int):
            self.num_speculative_tokens = num_speculative_tokens

        def propose(self, seqs, max_drafts):
            return Proposal([[] for _ in seqs])

    assert _missing(Smallest(1)) == [] and Smallest(1).setup(None) == ProposerPools()

    class NoFeedback:
        num_speculative_tokens, aux_layer_ids = 1, ()

        def setup(self, context):
            return ProposerPools()

        def propose(self, seqs, max_drafts):
            return Proposal([])

    assert _missing(NoFeedback()) == ["on_step"] and not isinstance(NoFeedback(), Proposer)
