"""``saguaro bench``: the parameters, the prompts (held-out text for the default pair), the timed rows of
each mode, the per-mode worker process, the bandwidth a row streams and the table / JSON report. May import
core, tensor_math, runtime.base (stats) and the top level; nothing imports this folder but the CLI."""
