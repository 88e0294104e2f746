"""``specdec bench``: an offline serving benchmark, with and without speculation, in one process.

The same prompts run twice through the engine's request/step loop, first without speculation (the
baseline) and then with the given speculative config, at a fixed concurrency; the result is the
table of seed 001 (Req/s, total and output tok/s, median TTFT, TPOT and ITL mean/median/p99, each
with the spec run's change against the baseline) plus the acceptance per position.

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
requests (the first ``warmup`` prompts, cycled) run before the clock starts and are not counted,
neither in the timings nor in the acceptance counters.
"""

from __future__ import annotations

import gc
import json
import random
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs
import numpy as np

# The metrics the table shows, with the spec run's relative change against the baseline.
DELTA_KEYS: tuple[str, ...] = (
    "request_throughput",
    "total_token_throughput",
    "output_throughput",
    "median_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
)

DEFAULT_SYNTHETIC_PROMPTS = 16


# ----------------------------------------------------------------------------- configuration
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _int_at_least(lowest: int, optional: bool = False):
    def check(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
        if optional and value is None:
            return
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= lowest):
            raise ValueError(f"{attr.name} ({_flag(attr.name)}) must be an int >= {lowest}, got {value!r}")

    return check


def _non_negative_float(_inst: Any, attr: attrs.Attribute, value: Any) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"{attr.name} ({_flag(attr.name)}) must be a number >= 0, got {value!r}")


@attrs.frozen
class BenchConfig:
    """One benchmark: the engine's settings (as ``LLM``'s) and the workload.

    - ``speculative_config``: the spec run's config (any ``LLM`` form); None runs the baseline only.
    - Workload: ``dataset`` (a JSONL file of ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``
      lines; its first ``num_prompts`` lines, all when None) or, without one, ``num_prompts``
      (default 16) synthetic prompts of ``input_len`` token ids drawn uniformly from the model's
      vocabulary (special tokens left out) with ``seed``. Every request generates ``output_len``
      tokens (``ignore_eos``) at ``temperature`` (0 = greedy).
    - ``concurrency``: requests in flight at most; ``warmup``: uncounted requests run first.
    - ``max_num_seqs`` None = ``concurrency``; ``max_model_len`` None = the longest prompt +
      ``output_len`` (so the default KV budget stays small).
    """

    model: str
    speculative_config: Any = None
    attention_backend: str = "torch"
    dtype: str = "auto"
    block_size: int | None = attrs.field(default=None, validator=_int_at_least(1, optional=True))
    kv_cache_memory: int | None = attrs.field(default=None, validator=_int_at_least(1, optional=True))
    max_model_len: int | None = attrs.field(default=None, validator=_int_at_least(2, optional=True))
    max_num_seqs: int | None = attrs.field(default=None, validator=_int_at_least(1, optional=True))
    num_prompts: int | None = attrs.field(default=None, validator=_int_at_least(1, optional=True))
    input_len: int = attrs.field(default=64, validator=_int_at_least(1))
    output_len: int = attrs.field(default=64, validator=_int_at_least(1))
    dataset: str | None = None
    concurrency: int = attrs.field(default=4, validator=_int_at_least(1))
    warmup: int = attrs.field(default=1, validator=_int_at_least(0))
    seed: int = attrs.field(default=0, validator=_int_at_least(0))
    temperature: float = attrs.field(default=0.0, validator=_non_negative_float)


# ----------------------------------------------------------------------------- prompts
def synthetic_prompts(num: int, input_len: int, vocab_size: int, exclude: Sequence[int], seed: int) -> list[list[int]]:
    """``num`` prompts of ``input_len`` ids drawn uniformly from ``range(vocab_size)`` minus ``exclude``."""
    skip = set(exclude)
    allowed = [t for t in range(vocab_size) if t not in skip]
    if not allowed:
        raise ValueError("the model's vocabulary holds only special tokens; pass --dataset with real prompts")
    rng = random.Random(seed)
    return [[rng.choice(allowed) for _ in range(input_len)] for _ in range(num)]


def read_dataset(path: str | Path, tokenizer, limit: int | None) -> list[list[int]]:
    """Prompt token ids from a JSONL file: one ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` a line.

    Blank lines are skipped; text needs the model folder's tokenizer. ``limit`` keeps the first
    prompts and must not exceed how many the file has.
    """
    from specdec.tokenizer import encode

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"dataset {str(path)!r} does not exist; pass a JSONL file of {{\"prompt\": ...}} lines")
    prompts: list[list[int]] = []
    with file.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(prompts) == limit:
                break
            if not line.strip():
                continue
            where = f"{str(path)}:{lineno}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg}); each line must be one JSON object") from None
            if not isinstance(entry, dict) or ("prompt" in entry) == ("prompt_token_ids" in entry):
                raise ValueError(f'{where}: each line needs exactly one of "prompt" (a string) or "prompt_token_ids"')
            if "prompt" in entry:
                text = entry["prompt"]
                if not isinstance(text, str) or not text:
                    raise ValueError(f'{where}: "prompt" must be a non-empty string')
                if tokenizer is None:
                    raise ValueError(
                        f'{where}: a text prompt, but the model folder has no tokenizer; use "prompt_token_ids"'
                    )
                prompts.append(encode(tokenizer, text))
            else:
                ids = entry["prompt_token_ids"]
                if not (
                    isinstance(ids, list)
                    and ids
                    and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
                ):
                    raise ValueError(f'{where}: "prompt_token_ids" must be a non-empty list of token ids >= 0')
                prompts.append(list(ids))
    if not prompts:
        raise ValueError(f"dataset {str(path)!r} holds no prompts")
    if limit is not None and len(prompts) < limit:
        raise ValueError(f"dataset {str(path)!r} has only {len(prompts)} prompts; lower --num-prompts")
    return prompts


# ----------------------------------------------------------------------------- one run
@attrs.define
class RequestRecord:
    """One request's arrival and emissions (``(time, tokens)``, one per step that gave it tokens)."""

    prompt_len: int
    arrival: float
    emissions: list[tuple[float, int]] = attrs.Factory(list)

    @property
    def output_len(self) -> int:
        return sum(n for _, n in self.emissions)

    @property
    def ttft(self) -> float:
        return self.emissions[0][0] - self.arrival

    @property
    def e2el(self) -> float:
        return self.emissions[-1][0] - self.arrival

    @property
    def itls(self) -> list[float]:
        times = [t for t, _ in self.emissions]
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        n = self.output_len
        return (self.e2el - self.ttft) / (n - 1) if n > 1 else None

    def as_dict(self, origin: float = 0.0) -> dict[str, Any]:
        """JSON-ready; ``arrival_s`` counts from ``origin`` (the run's start)."""
        return {
            "arrival_s": self.arrival - origin,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
            "ttft_ms": self.ttft * 1e3,
            "e2el_ms": self.e2el * 1e3,
            "tpot_ms": None if self.tpot is None else self.tpot * 1e3,
            "itl_ms": [x * 1e3 for x in self.itls],
            "tokens_per_emission": [n for _, n in self.emissions],
        }


def serve(
    engine, prompts: Sequence[Sequence[int]], params, concurrency: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[list[RequestRecord], float, float, list[list[int]]]:
    """Run ``prompts`` through ``engine`` with at most ``concurrency`` in flight.

    Returns the records (input order), the start time, the duration (first hand-over to last
    token) and the output token ids. Every request is validated before the clock starts (as
    ``LLMEngine.generate`` does), so a prompt that can never run fails before any work.
    """
    seqs = [engine.make_sequence(p, params, index=i) for i, p in enumerate(prompts)]
    records: list[RequestRecord | None] = [None] * len(seqs)
    pending = deque(range(len(seqs)))
    seen: dict[int, int] = {}  # in flight: index -> output tokens recorded so far
    start = clock()
    while pending or seen:
        while pending and len(seen) < concurrency:
            i = pending.popleft()
            records[i] = RequestRecord(len(prompts[i]), clock())
            engine.scheduler.add(seqs[i])
            seen[i] = 0
        engine.step()
        now = clock()
        for i in list(seen):
            seq = seqs[i]
            n = seq.num_output_tokens
            if n > seen[i]:
                records[i].emissions.append((now, n - seen[i]))
                seen[i] = n
            if seq.is_finished:
                del seen[i]
    duration = clock() - start
    return records, start, duration, [seq.output_token_ids for seq in seqs]  # type: ignore[return-value]


def _stats(name: str, seconds: Sequence[float]) -> dict[str, float]:
    # vLLM reports 0 for a metric with no samples (e.g. ITL when every request emits once).
    ms = np.asarray(seconds, dtype=np.float64) * 1e3 if len(seconds) else np.zeros(1)
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"std_{name}_ms": float(ms.std()),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


def summarize(records: Sequence[RequestRecord], duration: float) -> dict[str, Any]:
    """vLLM benchmark_serving's metrics for one run (times in ms, throughputs per second)."""
    inputs = sum(r.prompt_len for r in records)
    outputs = sum(r.output_len for r in records)
    return {
        "completed": len(records),
        "duration_s": duration,
        "total_input_tokens": inputs,
        "total_output_tokens": outputs,
        "request_throughput": len(records) / duration,
        "output_throughput": outputs / duration,
        "total_token_throughput": (inputs + outputs) / duration,
        **_stats("ttft", [r.ttft for r in records]),
        **_stats("tpot", [r.tpot for r in records if r.tpot is not None]),
        **_stats("itl", [x for r in records for x in r.itls]),
        **_stats("e2el", [r.e2el for r in records]),
    }


def deltas(baseline: dict[str, Any], spec: dict[str, Any]) -> dict[str, float | None]:
    """The spec run's relative change per table metric: (spec - baseline) / baseline; None if baseline is 0."""
    return {k: (spec[k] - baseline[k]) / baseline[k] if baseline[k] else None for k in DELTA_KEYS}


# ----------------------------------------------------------------------------- the benchmark
def _text_config(model: str):
    from specdec.models.loader import load_config

    config = load_config(model)
    get_text = getattr(config, "get_text_config", None)
    return get_text() if callable(get_text) else config


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def load_prompts(config: BenchConfig) -> list[list[int]]:
    """The benchmark's prompts as token ids (the dataset's or synthetic ones)."""
    from specdec.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    if config.dataset is not None:
        return read_dataset(config.dataset, tokenizer, config.num_prompts)
    text = _text_config(config.model)
    vocab = int(text.vocab_size)
    special = _ids(getattr(text, "bos_token_id", None)) + _ids(getattr(text, "eos_token_id", None))
    special += _ids(getattr(text, "pad_token_id", None))
    if tokenizer is not None:
        vocab = min(vocab, len(tokenizer))
        special += list(tokenizer.all_special_ids)
    num = config.num_prompts or DEFAULT_SYNTHETIC_PROMPTS
    return synthetic_prompts(num, config.input_len, vocab, special, config.seed)


def _max_model_len(config: BenchConfig, prompts: list[list[int]]) -> int:
    if config.max_model_len is not None:
        return config.max_model_len
    needed = max(len(p) for p in prompts) + config.output_len
    limit = getattr(_text_config(config.model), "max_position_embeddings", None)
    if limit and needed > limit:
        raise ValueError(
            f"the longest prompt ({needed - config.output_len} tokens) + --output-len {config.output_len} exceeds "
            f"the model's max_position_embeddings ({limit}); shorten the prompts or lower --output-len"
        )
    return needed


def _run(config: BenchConfig, spec, prompts, max_model_len: int, progress) -> dict[str, Any]:
    from specdec.llm import LLM
    from specdec.sampling.params import SamplingParams

    llm = LLM(
        config.model,
        speculative_config=spec,
        attention_backend=config.attention_backend,
        dtype=config.dtype,
        block_size=config.block_size,
        kv_cache_memory=config.kv_cache_memory,
        max_num_seqs=config.max_num_seqs or config.concurrency,
        max_model_len=max_model_len,
        seed=config.seed,
    )
    params = SamplingParams(max_tokens=config.output_len, temperature=config.temperature, ignore_eos=True)
    engine = llm.engine
    if config.warmup:
        progress(f"warm-up: {config.warmup} request(s)")
        warm = [prompts[i % len(prompts)] for i in range(config.warmup)]
        serve(engine, warm, params, config.concurrency)
        llm.reset_spec_stats()
    progress(f"{len(prompts)} requests at concurrency {config.concurrency}")
    preempted = engine.scheduler.num_preemptions
    records, start, duration, outputs = serve(engine, prompts, params, config.concurrency)
    result = summarize(records, duration)
    # Recomputed requests slow a run down; a figure worth seeing next to the timings.
    result["num_preemptions"] = engine.scheduler.num_preemptions - preempted
    stats = llm.spec_stats()
    result["spec_stats"] = stats.as_dict() if stats is not None else None
    result["requests"] = [r.as_dict(start) for r in records]
    result["_outputs"] = outputs
    del llm, engine
    gc.collect()  # the next run's model and cache should not sit next to this one's
    return result


def run_benchmark(config: BenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the baseline (and the spec run when ``config.speculative_config`` is set); one JSON-ready dict.

    Keys: ``settings``; ``baseline`` and ``speculative`` (None without a config): the metrics of
    :func:`summarize` plus ``num_preemptions``, ``spec_stats`` and ``requests`` (per request:
    ``arrival_s``, ``prompt_len``, ``output_len``, ``ttft_ms``, ``e2el_ms``, ``tpot_ms``, ``itl_ms``,
    ``tokens_per_emission``);
    ``deltas`` (see :func:`deltas`); ``identical_outputs``: how many requests produced the same
    tokens in both runs (all of them, greedy in float64; lower precisions may differ by rounding).
    """
    from specdec.proposers.config import parse_speculative_config

    say = progress or (lambda _msg: None)
    spec = parse_speculative_config(config.speculative_config)  # a bad config fails before any run
    prompts = load_prompts(config)
    max_model_len = _max_model_len(config, prompts)
    settings = {
        "model": config.model,
        "speculative_config": spec.to_dict() if spec is not None else None,
        "attention_backend": config.attention_backend,
        "dtype": config.dtype,
        "block_size": config.block_size,
        "dataset": config.dataset,
        "num_prompts": len(prompts),
        "mean_input_len": sum(map(len, prompts)) / len(prompts),
        "output_len": config.output_len,
        "concurrency": config.concurrency,
        "warmup": config.warmup,
        "temperature": config.temperature,
        "seed": config.seed,
        "max_model_len": max_model_len,
    }
    say("baseline (no speculation)")
    baseline = _run(config, None, prompts, max_model_len, say)
    speculative = None
    if spec is not None:
        say(f"speculative ({spec.method}, k={spec.num_speculative_tokens})")
        speculative = _run(config, spec, prompts, max_model_len, say)
    base_out = baseline.pop("_outputs")
    identical = None
    if speculative is not None:
        spec_out = speculative.pop("_outputs")
        identical = sum(a == b for a, b in zip(base_out, spec_out))
    return {
        "settings": settings,
        "baseline": baseline,
        "speculative": speculative,
        "deltas": deltas(baseline, speculative) if speculative is not None else None,
        "identical_outputs": identical,
    }


# ----------------------------------------------------------------------------- the table
def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def _triple(run: dict[str, Any], name: str) -> str:
    return "/".join(f"{run[f'{s}_{name}_ms']:.2f}" for s in ("mean", "median", "p99"))


def _length(n: float) -> str:
    n = round(n)
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def format_table(result: dict[str, Any]) -> str:
    """The seed 001 table (one row per run, deltas against the baseline) and the acceptance lines."""
    s = result["settings"]
    spec_cfg = s["speculative_config"]
    runs = [("no", result["baseline"], None)]
    if result["speculative"] is not None:
        label = f"{spec_cfg['method']} k={spec_cfg['num_speculative_tokens']}"
        runs.append((label, result["speculative"], result["deltas"]))
    header = [
        "Spec", "ISL/OSL", "Conc", "Req/s", "delta", "Total tok/s", "delta", "Output tok/s", "delta",
        "median TTFT (ms)", "delta", "TPOT mean/med/p99 (ms)", "delta", "ITL mean/med/p99 (ms)", "delta",
    ]
    rows = [header]
    lengths = f"{_length(s['mean_input_len'])}/{_length(s['output_len'])}"
    for label, run, d in runs:
        d = d or {}
        rows.append([
            label, lengths, str(s["concurrency"]),
            f"{run['request_throughput']:.3f}", _pct(d.get("request_throughput")),
            f"{run['total_token_throughput']:.1f}", _pct(d.get("total_token_throughput")),
            f"{run['output_throughput']:.1f}", _pct(d.get("output_throughput")),
            f"{run['median_ttft_ms']:.1f}", _pct(d.get("median_ttft_ms")),
            _triple(run, "tpot"), _pct(d.get("mean_tpot_ms")),
            _triple(run, "itl"), _pct(d.get("mean_itl_ms")),
        ])
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = [
        f"model: {s['model']}  backend: {s['attention_backend']}  dtype: {s['dtype']}  "
        f"prompts: {s['num_prompts']} ({'dataset ' + s['dataset'] if s['dataset'] else 'synthetic'})  "
        f"warm-up: {s['warmup']}",
    ]
    for row in rows:  # the label left-aligned, numbers right-aligned
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    lines.append(
        "duration (s): " + ", ".join(f"{label} {run['duration_s']:.2f}" for label, run, _ in runs)
        + "; preemptions: " + ", ".join(f"{label} {run['num_preemptions']}" for label, run, _ in runs)
        + "; ITL counts one gap per emission (a speculative step emits several tokens at once), as vLLM does"
    )
    spec_run = result["speculative"]
    if spec_run is not None:
        st = spec_run["spec_stats"]
        per_position = ", ".join(f"{a:.3f}" for a in st["acceptance_per_position"])
        lines.append(
            f"acceptance per position: {per_position}; draft acceptance rate {st['draft_acceptance_rate'] * 100:.1f}%; "
            f"mean acceptance length {st['mean_acceptance_length']:.2f} ({st['num_drafts']} drafts)"
        )
        lines.append(f"outputs identical to the baseline: {result['identical_outputs']}/{s['num_prompts']}")
    return "\n".join(lines)


def progress_to_stderr(message: str) -> None:
    """Progress lines, only for a person watching (a terminal), so captured stderr stays clean."""
    if sys.stderr.isatty():
        print(f"bench: {message}", file=sys.stderr, flush=True)
