"""Exported programs: ``program.export(path)`` writes an artifact directory, ``saguaro.load(path)`` loads it."""
