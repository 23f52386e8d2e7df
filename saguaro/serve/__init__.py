"""``saguaro serve``: an OpenAI-compatible HTTP server over a Program (starlette + uvicorn), its request
checks, its batching scheduler and its Prometheus metrics. May import the top level, saguaro.core and
saguaro.runtime (a Program's public surface); only the CLI imports it."""
