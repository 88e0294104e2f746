"""``specdec serve``: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

``args`` (the command line, vLLM's spellings), ``engine_core`` (the engine loop and its messages),
``transport`` (its own process, or a thread), ``async_engine`` (the event loop's side: submit, abort,
per-request deltas), ``api`` (the routes), ``protocol`` / ``responses`` (request and response bodies), ``metrics``
(Prometheus and the stats line), ``launch`` (starting and stopping).
"""
