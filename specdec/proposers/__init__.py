"""Proposers: the protocol, the method registry and the speculative config.

Proposer implementations (``ngram``, ``draft_model``, ``eagle3``) are imported by the
registry when their method is chosen.
"""

from specdec.proposers.base import Proposal, Proposer, ProposerBase, ProposerContext, StepFeedback
from specdec.proposers.config import SpeculativeConfig, parse_speculative_config
from specdec.proposers.registry import available_proposers, create_proposer, register_proposer

__all__ = [
    "Proposal",
    "Proposer",
    "ProposerBase",
    "ProposerContext",
    "SpeculativeConfig",
    "StepFeedback",
    "available_proposers",
    "create_proposer",
    "parse_speculative_config",
    "register_proposer",
]
