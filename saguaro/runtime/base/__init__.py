"""What every runtime folder builds on: stage runner, KV store, sequences, decode state, counters and stats,
input checks, trace recorder and reader, tensor wire. May import core, capture and tensor_math only."""
