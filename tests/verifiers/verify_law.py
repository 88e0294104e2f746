"""A toy two-position language (target logits L0, L1; draft logits Q0, Q1) run through a verifier,
step by step, for thousands of seeded trials: what the verifiers' law tests (chi-squared against the
exact joint law of the first two tokens) and their negative controls share."""

import attrs
import torch
from scipy import stats

from specdec.sampling import STREAM_DRAFT, SamplingBatch, SamplingParams, categorical, target_probs
from specdec.verifiers.base import assemble

V = 5
N_TRIALS = 20000
P_MIN = 0.001

# Target logits at position 0, and at position 1 given the token at position 0 (row = that token).
L0 = torch.tensor([1.2, 0.3, -0.4, 0.8, 0.0], dtype=torch.float64)
L1 = torch.tensor(
    [[0.5, -0.2, 1.0, 0.0, 0.3],
     [-1.0, 0.9, 0.2, 0.4, 0.0],
     [0.0, 0.0, 1.5, -0.5, 0.7],
     [0.6, 0.6, -0.3, 1.1, -1.0],
     [1.3, -0.4, 0.0, 0.2, 0.5]], dtype=torch.float64)
# Deliberately different draft logits (the drafter's model), same conditioning.
Q0 = torch.tensor([-0.5, 1.5, 0.6, -1.0, 0.9], dtype=torch.float64)
Q1 = L1.flip(1) * 1.5

CASES = {
    "temperature=1": SamplingParams(temperature=1.0),
    "top_p=0.8": SamplingParams(temperature=1.0, top_p=0.8),
    "top_k=3": SamplingParams(temperature=1.0, top_k=3),
    "t=0.7,top_k=4,top_p=0.9": SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
}


class AlwaysAccept:
    """Negative control: keeps every draft and samples the bonus from p. Not lossless."""

    def verify(self, target_logits, draft_token_ids, num_drafts, draft_probs, batch):
        rows = torch.cumsum(num_drafts + 1, 0) - 1
        last = batch.select(torch.arange(len(batch)))
        p = target_probs(target_logits[rows], last.temperature, last.top_k, last.top_p)
        bonus = categorical(p, last.seeds, last.counters + num_drafts, 0)
        return assemble(draft_token_ids.clamp(min=0), num_drafts, bonus)


def target_logits_for(history_last, position):
    """Row of target logits for the next token at ``position`` given the previous token."""
    return L0.expand(len(history_last), -1) if position == 0 else L1[history_last]


def draft_step(batch, start, prev, k, sampled_drafter):
    """Draft k tokens from positions start.. for each trial; returns drafts [N,k] and q [N,k,V]."""
    n, seeds = len(batch), batch.seeds
    drafts, probs = [], []
    for j in range(k):
        pos = start + j
        q_logits = Q0.expand(n, -1) if pos == 0 else Q1[prev]
        if sampled_drafter:
            q = target_probs(q_logits, batch.temperature, batch.top_k, batch.top_p)
            tok = categorical(q, seeds, torch.full((n,), pos, dtype=torch.int64), STREAM_DRAFT)
        else:  # deterministic drafter: argmax of its logits, one-hot q
            tok = q_logits.argmax(-1)
            q = torch.nn.functional.one_hot(tok, V).to(torch.float64)
        drafts.append(tok)
        probs.append(q)
        prev = tok
    return torch.stack(drafts, 1), torch.stack(probs, 1)


def simulate(verifier, params, k, sampled_drafter, num_tokens=2, n=N_TRIALS):
    """Run speculative steps until each trial emitted ``num_tokens`` tokens; returns [n, num_tokens]."""
    everyone = SamplingBatch.from_params([params] * n, [0] * n, default_seeds=range(12345, 12345 + n))
    out = torch.full((n, num_tokens), -1, dtype=torch.int64)
    length = torch.zeros(n, dtype=torch.int64)
    while bool((length < num_tokens).any()):
        live = (length < num_tokens).nonzero().squeeze(1)
        start = int(length[live].min())  # trials of one length advance together, the shortest first
        live = live[length[live] == start]
        prev = out[live, start - 1] if start > 0 else torch.zeros(len(live), dtype=torch.int64)
        batch = attrs.evolve(everyone.select(live), counters=torch.full((len(live),), start, dtype=torch.int64))
        drafts, q = draft_step(batch, start, prev, k, sampled_drafter)
        rows = [target_logits_for(prev, start)]
        for j in range(k):
            rows.append(target_logits_for(drafts[:, j], start + j + 1))
        logits = torch.stack(rows, 1).reshape(len(live) * (k + 1), V)
        res = verifier.verify(logits, drafts, torch.full((len(live),), k), q if sampled_drafter else None, batch)
        for j in range(min(k + 1, num_tokens - start)):
            take = res.num_emitted > j
            out[live[take], start + j] = res.output_token_ids[take, j]
        length[live] = torch.clamp(length[live] + res.num_emitted, max=num_tokens)
    return out


def exact_law(params):
    one = SamplingBatch.from_params([params] * V, [0] * V, default_seeds=[0] * V)
    p0 = target_probs(L0[None], one.temperature[:1], one.top_k[:1], one.top_p[:1])[0]
    p1 = target_probs(L1, one.temperature, one.top_k, one.top_p)
    return p0, p0[:, None] * p1  # first-token law, joint law of the first two tokens


def chi2_pvalue(tokens, law):
    """Chi-squared p-value of the emitted tokens ([n] or [n, 2] pairs) against ``law``.

    An emitted token of zero target probability is impossible under the law: p-value 0.
    """
    flat = tokens[:, 0] * V + tokens[:, 1] if tokens.dim() == 2 else tokens
    law = law.reshape(-1)
    counts = torch.bincount(flat, minlength=law.numel())
    if int(counts[law == 0].sum()) > 0:
        return 0.0
    live = law > 0
    return stats.chisquare(counts[live].numpy(), (law[live] * len(flat)).numpy()).pvalue
