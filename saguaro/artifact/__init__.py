"""Exported programs: ``program.export(path)`` writes an artifact directory, ``saguaro.load(path)``
loads it. May import core, capture, passes, lower and runtime; the runtime never imports it."""
