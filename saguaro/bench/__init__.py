"""``saguaro bench``: the parameters, the prompts (held-out text for the default pair), the timed rows of
each mode, the per-mode worker process and the table / JSON report. May import runtime.base (stats) and
the top-level compile, default_pair and models_io; nothing imports this folder but the CLI."""
