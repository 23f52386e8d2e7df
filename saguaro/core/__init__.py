"""The leaf layer: errors, the validated config, the stage table and the round schedule. Imports no other
Saguaro package (the stage table names its :mod:`saguaro.tensor_math` epilogues by string)."""
