"""The runtime: a compiled pair's :class:`~saguaro.runtime.program.Program` and what it runs.
Lives here: the Program, its generation plan, calibration and streaming; below them ``decode`` → ``lanes`` →
``draft`` → ``base``. May import core, capture (model specs) and tensor_math; never passes or lowering."""
