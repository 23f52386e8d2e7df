"""What every runtime folder builds on: a model's stage runner, KV store, sequences, decode state,
counters and stats, input checks, the trace recorder and reader, the tensor wire (``wire.Channel``).
May import core, capture (the model spec) and tensor_math; nothing else of the runtime."""
