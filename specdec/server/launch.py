"""``specdec serve``: build the engine, wrap it in the HTTP API and run uvicorn until SIGTERM or Ctrl-C.

On a shutdown signal uvicorn stops accepting connections and lets in-flight requests finish (streams
get :data:`~specdec.server.api.STREAM_GRACE_SECONDS`), then the engine thread stops and the process
exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Sequence

import attrs

from specdec.server.args import ServerArgs

log = logging.getLogger("specdec.server")


class Server:
    """Everything the routes need: the arguments, the tokenizer, the engine's front end and the metrics.

    The engine runs in a process of its own unless ``args.engine_process`` is off; then ``llm`` is
    the in-process ``LLM`` (None otherwise).
    """

    def __init__(self, args: ServerArgs):
        from specdec.server.async_engine import AsyncEngine
        from specdec.server.metrics import ServerMetrics
        from specdec.server.transport import EngineProcess, EngineThread

        self.args = args
        self.llm = None
        if args.engine_process:
            from specdec.tokenizer import load_tokenizer

            if args.tensor_parallel_size > 1:
                from specdec.engine.workers import check_shards

                check_shards(args)  # a size that does not shard: one line here, before any process starts
            transport = EngineProcess(args)
            self.tokenizer = load_tokenizer(args.model)
        else:
            from specdec.llm import LLM

            self.llm = LLM.from_engine_args(args)  # a ServerArgs is an EngineArgs with the server's fields
            transport = EngineThread(self.llm)
            self.tokenizer = self.llm.tokenizer
        self.max_model_len = transport.max_model_len
        self.num_speculative_tokens = transport.num_speculative_tokens
        self.metrics = ServerMetrics(args.model_name, self.num_speculative_tokens, interval=args.stats_interval)
        self.engine = AsyncEngine(transport, self.metrics, max_waiting_requests=args.max_waiting_requests)

    def engine_alive(self) -> bool:
        return self.engine.alive()


def fit_max_model_len(args: ServerArgs) -> tuple[ServerArgs, str | None]:
    """Cap ``max_model_len`` at the model's ``max_position_embeddings`` (with a warning line), so a
    command line written for a larger checkpoint still starts."""
    if args.max_model_len is None:
        return args, None
    from specdec.bench.workload import text_config

    limit = getattr(text_config(args.model), "max_position_embeddings", None)
    if limit and args.max_model_len > limit:
        warning = (f"warning: --max-model-len {args.max_model_len} exceeds the model's max_position_embeddings "
                   f"({limit}); serving {limit}")
        return attrs.evolve(args, max_model_len=limit), warning
    return args, None


def serve(args: ServerArgs) -> None:
    """Start the server and block until it is told to stop."""
    import uvicorn

    from specdec.server.api import STREAM_GRACE_SECONDS, create_app

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    server = Server(args)
    app = create_app(server)
    log.info("serving %s (%s) on http://%s:%d", args.model_name,
             f"speculative: {args.speculative_config.to_string()}" if args.speculative_config else "no speculation",
             args.host, args.port)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then sends the signal again to whatever handler
    # was there before it started; the signal has been handled by then, so that handler does nothing
    # and the process exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=int(STREAM_GRACE_SECONDS) + 5)
    log.info("stopped")


def main(parser, argv: Sequence[str]) -> int:
    """``specdec serve MODEL [flags]`` (``parser`` is the subcommand's, already built)."""
    from specdec.server.args import parse_server_args

    args, warnings = parse_server_args(parser, argv)
    args, capped = fit_max_model_len(args)
    for line in [*warnings, *([capped] if capped else [])]:
        print(line, file=sys.stderr)
    serve(args)
    return 0
