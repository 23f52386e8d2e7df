"""Exported programs: ``program.export(path)`` writes an artifact directory, ``saguaro.load(path)``
loads it. May import core, capture, passes, lower, runtime and tensor_math; the runtime never imports it."""
