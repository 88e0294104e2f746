"""``specdec bench``: an offline serving benchmark, with and without speculation, in one process.

The same prompts run twice through the engine's request/step loop, first without speculation (the
baseline) and then with the given speculative config, at a fixed concurrency, and again at each
further temperature (``--temperature 0,0.7``: greedy and sampled), every run on a fresh engine; the
result is the table of seed 001 (Req/s, total and output tok/s, median TTFT, TPOT and ITL
mean/median/p99, each with the spec run's change against the baseline at its temperature) plus, per
spec run, the acceptance per position and the drafts chosen per (request, step) (``k chosen``, from
``num_drafts_histogram``: the cap ``k`` without ``adaptive``, the goodput controller's choices with it).

Definitions follow vLLM's ``benchmark_serving`` (a client streaming from a server):

- a request *arrives* when the benchmark hands it to the engine. At most ``concurrency`` requests
  are in flight; a new one is handed over as soon as one finishes (vLLM's client starts its clock
  after its concurrency semaphore lets the request through, so the same holds there). Time spent
  queued inside the engine counts, as it does behind a server.
- token timestamps are taken when ``engine.step()`` returns, i.e. when a server would stream the
  step's tokens: after verification and after the proposer's bookkeeping for the next step.
- TTFT = first output token - arrival; E2EL = last output token - arrival.
- TPOT = (E2EL - TTFT) / (output_len - 1), per request with more than one output token.
- ITL = the gaps between consecutive *emissions* of a request. A speculative step emits several
  tokens at once; like vLLM (one streamed chunk, one gap) that is a single ITL entry, so with
  speculation ITL grows with the acceptance length while TPOT falls.
- Req/s, output tok/s and total tok/s: completed requests, output tokens and prompt + output tokens
  over the run's duration (first hand-over to last token).

Every request uses ``ignore_eos`` so both runs produce the same number of tokens. Warm-up
requests (``warmup`` prompts of their own, shaped like the workload's) run before the clock starts and
are not counted, neither in the timings nor in the acceptance or prefix-cache counters.

Prompts are held-out text by default: windows of the training corpus's validation-split stdlib
files, which no zoo model trained on (:mod:`specdec.bench.workload` says how they are cut and checked
against the training text); ``settings.prompt_source`` and the table's first line name the source.
Workloads (:mod:`specdec.bench.workload`): ``single`` prompts (held-out, synthetic or a dataset's),
``shared-prefix`` (many requests over a few long system prompts) and ``multi-turn`` (each turn's
prompt is the previous turn's prompt + its output + a new user message, sent once that output is
known). Each run also reports its prefix-cache ``queries`` and ``hits`` (tokens of admitted requests
looked up and found cached, vLLM's counters) and their ``hit_rate``.
"""

from specdec.bench.config import BenchConfig
from specdec.bench.metrics import DELTA_KEYS, RequestRecord, deltas, summarize
from specdec.bench.runner import run_benchmark, serve
from specdec.bench.table import format_table, progress_to_stderr
from specdec.bench.workload import Workload, load_prompts, load_workload, read_dataset, synthetic_prompts

__all__ = [
    "DELTA_KEYS",
    "BenchConfig",
    "RequestRecord",
    "Workload",
    "deltas",
    "format_table",
    "load_prompts",
    "load_workload",
    "progress_to_stderr",
    "read_dataset",
    "run_benchmark",
    "serve",
    "summarize",
    "synthetic_prompts",
]
