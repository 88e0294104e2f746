"""The acceptance alarm: a collapsed draft or request is named once, as soon as the counts make it
certain; healthy rates never are; a planted proposer state bug trips the per-request alarm."""

from __future__ import annotations

import logging
import math
import random

import attrs
import pytest

from specdec import LLM, SamplingParams
from specdec.engine.acceptance_alarm import AcceptanceAlarm, DraftExpectation, binomial_cdf
from specdec.proposers import register_proposer
from specdec.proposers.eagle3.proposer import Eagle3Proposer
from specdec.proposers.registry import PROPOSERS
from specdec.train.corpus import validation_prompts
from specdec.zoo import ZOO_DIR

RECORDED = DraftExpectation("eagle3", "drafts/kimi", (0.873, 0.5, 0.3))


def feed(alarm: AcceptanceAlarm, rates: list[float], steps: int, seed: int = 0) -> list[tuple[int, str]]:
    """``steps`` steps of one draft per request, request i accepting at position 0 with ``rates[i]``;
    every warning with the step it came in."""
    rng = random.Random(seed)
    found = []
    for step in range(steps):
        accepted = [int(rng.random() < r) for r in rates]
        found += [(step, w) for w in alarm.observe(list(range(len(rates))), [3] * len(rates), accepted)]
    return found


def test_binomial_cdf():
    exact = sum(math.comb(30, i) * 0.2**i * 0.8 ** (30 - i) for i in range(5))
    assert binomial_cdf(4, 30, 0.2) == pytest.approx(exact, rel=1e-12)
    assert binomial_cdf(0, 10_000, 0.3) == 0.0 and binomial_cdf(10, 10, 0.5) == 1.0


def test_a_collapsed_draft_is_named_once_as_soon_as_it_is_certain(caplog):
    alarm = AcceptanceAlarm(RECORDED)
    assert alarm.collapse_horizon == 38  # (1 - 0.873 / 4) ** 38 < 1e-4
    with caplog.at_level(logging.WARNING, logger="specdec"):
        found = feed(alarm, [0.0] * 4, 40)
    assert [step for step, _ in found] == [9]  # the step that reached 40 >= 38 drafts
    message = found[0][1]
    for needle in ("eagle3 draft 'drafts/kimi'", "0 of 40 drafts", "records 0.873", "another target",
                   "aux layer ids", "d2t", "fc_norm, norm_output"):
        assert needle in message
    assert caplog.messages == [message] and "\n" not in message


def test_without_a_record_only_near_zero_is_far_below():
    alarm = AcceptanceAlarm(DraftExpectation("draft_model", "d"))
    assert alarm.collapse_horizon == 180  # 0.95 ** 180 < 1e-4
    assert feed(alarm, [0.12] * 8, 200) == []  # poor, not broken
    assert len(feed(AcceptanceAlarm(DraftExpectation("draft_model", "d")), [0.0] * 8, 30)) == 1


def test_healthy_drafts_and_requests_never_warn():
    # Rates down to 0.35 of the recorded one, and requests from 0.2 to 0.8: what sampling, synthetic
    # prompts and hard text do to the zoo's drafts, well above the floors.
    alarm = AcceptanceAlarm(RECORDED)
    rates = [0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8]
    assert feed(alarm, rates, 2000, seed=1) == []
    assert feed(AcceptanceAlarm(RECORDED), [0.31] * 8, 2000, seed=2) == []


def test_one_collapsed_request_is_named_once_and_forgotten_when_it_ends():
    alarm = AcceptanceAlarm(RECORDED)
    found = feed(alarm, [0.6, 0.6, 0.0, 0.6, 0.6], 80, seed=3)
    assert len(found) == 1 and 40 <= found[0][0] < 60
    message = found[0][1]
    assert "request 2 had 0 of its" in message and "state bug" in message and not alarm.draft_warned
    alarm.forget(2)
    assert alarm.observe([2], [3], [0]) == []  # a fresh count: one draft proves nothing


class StaleRollback(Eagle3Proposer):
    """Planted state bug: after every step, request 1's drafting state is rolled back to the snapshot
    of its first drafting step, so it keeps drafting the continuation of text long gone."""

    victim = 1

    def propose(self, seqs, max_drafts):
        proposal = super().propose(seqs, max_drafts)
        ids = list(proposal.draft_token_ids)
        for i, seq in enumerate(seqs):
            if seq.seq_id == self.victim and ids[i]:
                self.snapshot = getattr(self, "snapshot", None) or ids[i]
                ids[i] = self.snapshot[: len(ids[i])]
        return attrs.evolve(proposal, draft_token_ids=ids)


@pytest.fixture
def stale_rollback():
    register_proposer("stale-rollback", StaleRollback)
    yield "stale-rollback"
    PROPOSERS.unregister("stale-rollback")


def test_a_planted_state_bug_trips_the_request_alarm(stale_rollback, caplog):
    target = ZOO_DIR / "llama-tiny"
    spec = {"method": stale_rollback, "model": str(ZOO_DIR / "llama-tiny-eagle3"), "num_speculative_tokens": 3}
    llm = LLM(str(target), speculative_config=spec, dtype="float32", max_num_seqs=6, kv_cache_memory=32 << 20)
    with caplog.at_level(logging.WARNING, logger="specdec"):
        llm.generate(validation_prompts(target, 6, 16), SamplingParams(max_tokens=64, ignore_eos=True),
                     use_tqdm=False)
    warnings = llm.spec_stats().warnings
    assert len(warnings) == 1 and "request 1 had" in warnings[0] and "state bug" in warnings[0]
    assert caplog.messages == warnings
