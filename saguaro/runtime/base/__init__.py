"""What every runtime folder builds on: a model's stage runner, KV store, sequences, decode state,
counters and stats, input checks and the trace recorder and reader.
May import core, capture (the model spec) and tensor_math; nothing else of the runtime."""
