"""``specdec serve``: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn).

``args`` (the command line, vLLM's spellings), ``async_engine`` (the engine thread and per-request
deltas), ``api`` (the routes), ``protocol`` / ``responses`` (request and response bodies), ``metrics``
(Prometheus and the stats line), ``launch`` (starting and stopping).
"""
