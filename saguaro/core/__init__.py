"""The leaf layer every other package reads: errors, the validated config, the stage table and the
round schedule. Nothing here imports another Saguaro package (the stage table names its epilogues, functions
of :mod:`saguaro.tensor_math`, by name, and looks them up when a stage is built)."""
