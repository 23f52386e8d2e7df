"""The one validated, frozen configuration of a Saguaro program."""

from __future__ import annotations

import re
from dataclasses import dataclass

from saguaro.core.errors import ConfigError

MODES = ("ar", "sd", "ssd")
BACKENDS = ("eager", "inductor")
FALLBACKS = ("auto", "neural", "fast")
LANES = ("auto", "thread", "process", "remote")
ATTENTIONS = ("auto", "op", "inline", "flex", "reduce", "kernel")
LINEARS = ("auto", "gemm", "reduction", "packed", "template")
COMPILE_MODES = ("blocking", "background")
WEIGHTS = ("as-loaded", "int8", "int4")
MAX_K = 16
DRAFT_DEVICE_TYPES = ("cpu", "cuda")
_DEVICE = re.compile(r"([a-z_]+)(?::(\d+))?")  # a torch device string: type[:index]


@dataclass(frozen=True)
class SaguaroConfig:
    """Options of :func:`saguaro.compile`. Every field is validated in ``__post_init__``.

    k: speculation length, 1..16.
    mode: ``"ar"`` (target alone), ``"sd"`` (speculative decoding) or ``"ssd"``.
    backend: ``"inductor"`` (``torch.compile`` of every stage, the default, as ``torch.compile`` compiles
        by default) or ``"eager"`` (the stage GraphModules themselves: quick to start, for debugging).
    compile: when Inductor compiles (``backend="inductor"``; ignored by ``"eager"``). ``"blocking"``, the
        default: a stage's first call with new shapes waits for its compile (10-20 s per stage graph and
        shape bucket on a CPU with a cold cache), so every call runs compiled code: what benchmarks time.
        ``"background"`` (``saguaro generate``'s default): such a call runs the stage's eager form (its
        GraphModule) at once while one background thread compiles it for those shapes; later calls with
        those shapes run compiled (``saguaro.lower.tiered``; ``program.wait_compiled()`` waits for the
        queue). Greedy tokens are the same either way; a sampled generation may switch forms mid-run, so
        a seed reproduces its tokens only with ``"blocking"``. With ``sd_when_faster``, an SSD generation
        runs SD's rounds the first time its shape comes and while compiles are queued, so the planner
        times SSD on compiled stages only. CUDA-graph stages always block.
    fallback: on an SSD cache miss, ``"neural"``, ``"fast"`` or ``"auto"`` (the one with the higher measured
        tokens per second, the other taken again after 8 rounds of one in a row).
    fan_out: ``"auto"`` (the planner, :mod:`saguaro.runtime.draft.planner`, picks each round's branch count
        among the multiples of ``k+1`` up to the budget, 0 meaning an SD round, and its fan-out from
        measured costs and outcomes), ``"geometric"`` (always the whole budget, split geometrically),
        an int (uniform; 0 disables the tree) or a list of ``k+1`` ints.
    fan_out_budget: total branches ``MQ`` (for ``"auto"``, the most a round may use); default ``3·(k+1)``.
    saguaro_c: Saguaro sampling down-weighting constant in (0, 1]; 1 disables it.
    max_seq_len: the most tokens (prompt + new) per sequence; default the target's maximum positions.
        The KV store also holds each round's speculation slots (and SSD's tree scratch), and with
        inductor its capacity is rounded up to the shape bucket (``saguaro.lower.lowering.CAPACITY_BUCKET``).
    lane: where SSD's draft side runs: ``"thread"`` (a worker thread), ``"process"`` (another
        process over an anonymous socket pair, ``saguaro.runtime.lanes.process``) or ``"auto"``: the
        thread lane (its own CUDA stream on GPU) except for the eager backend on CPU, where the GIL,
        held while FX graphs are interpreted, makes a thread lane slow the target's verification, so
        the process lane wins (Inductor's C++ wrapper runs the kernels without the GIL, so there the
        thread lane wins; measured in ``benchmarks/README.md``, "Backends and lanes"). ``"remote"``: a
        ``saguaro draft-server`` at ``draft_address`` (``saguaro.runtime.lanes.remote``); ``"auto"`` with a
        ``draft_address`` means ``"remote"``.
    draft_address: ``"HOST:PORT"`` of the draft server of ``lane="remote"`` (None otherwise).
    draft_secret_file: a file holding the secret shared with the draft server (None: the environment
        variable ``SAGUARO_DRAFT_SECRET``, else no secret, which a server on loopback accepts).
    attention: how the stages run attention (the ``lower_attention`` pass): ``"op"`` (the
        ``saguaro::attention`` custom op), ``"inline"`` (its math inline, so Inductor fuses the KV
        write, and SDPA over a dense mask), ``"flex"`` (FlexAttention under a block mask built in the
        graph, every stage; opt-in, see :func:`saguaro.lower.lowering.attention_implementation`),
        ``"reduce"`` (AR's one-query target stages as the compiler's own products and sums instead of an SDPA
        call, the other stages inline; what ``"auto"`` does on CPU) or
        ``"auto"``: op for the eager backend, inline for Inductor (reduce for AR's target stages on CPU). The tree stage of Inductor on CUDA
        is written to take flex under ``"auto"`` (``saguaro.lower.lowering.FLEX_TREE_ON_CUDA``, a
        one-line switch), off until ``benchmarks/gpu_probe.py`` shows it exact and faster than SDPA.
    linears: how the linear layers of the few-row stages (step, round, verify, glue, tree; the prefill only as
        ``"packed"``, never as reductions) run:
        ``"reduction"`` (the ``linear_as_reduction`` pass: a product and a sum that Inductor fuses into one
        reduction reading each weight once for all rows), ``"gemm"`` (the BLAS call, as captured) or
        ``"packed"`` (the ``pack_linears`` pass: a C++ kernel built at first use with the machine's instruction
        set, cached on disk, over each weight packed once in panels of 64 columns, held narrow where
        ``narrow_weights`` and exact (16-bit weights as loaded) and widened in registers, up to 6 rows x 64
        columns register-blocked, each thread streaming its panels front to back, one row
        over several panels; the linears of one input joined into one call) or ``"auto"``: for Inductor on
        CPU, packed for every few-row stage and the prefill (where the kernel cannot be built, reduction, and
        BLAS for the prefill); gemm elsewhere (see
        :func:`saguaro.lower.lowering.linear_implementation`). ``"template"`` (Inductor on CPU; elsewhere as
        ``"auto"``): as ``"auto"``, but the stages of several rows per sequence (verify, glue, tree) keep their
        GEMMs, compiled with Inductor's freezing (the weights become constants, packed once) and its C++ GEMM
        template (register-blocked over the rows): SD's verify about 1.4x faster here. Costs: each such stage
        holds its own packed copy of the weights, and Inductor does not cache a frozen graph across
        processes (about 20 s more compile per process for the default pair). Inductor's stages on CUDA join
        each layer's q/k/v and gate/up projections into one linear each (the ``fuse_projections`` pass; one
        stacked copy of those weights beside the model's, taken when a stage is built); on a CPU the packed
        stages join them themselves, and the reductions do not (exact there, but slower).
    narrow_weights: True (the default): in Inductor's stages whose linears are reductions or packed
        (``linears`` above: on a CPU every decode stage under ``"auto"``, the one-row ones under
        ``"template"``; packed panels on any backend), each
        float32 weight whose values are all exactly float16 (or bfloat16) values, as in a checkpoint
        published in that dtype and loaded as float32, is held in that dtype and widened to float32 inside
        the kernels that read it (the ``narrow_weights`` pass): float32 arithmetic on the same values,
        outputs equal up to float32 rounding order (Inductor's kernels reading the narrow weights add in
        another order; greedy tokens tested equal to ``generate``), half the bytes streamed per token.
        The copies are taken when a stage is built: weights changed in place later are not seen there
        (as ``"template"``'s frozen ones); compile again. False keeps every weight as loaded. Other
        weights, and other stages, are never changed.
    cuda_graphs: run the fixed-shape stages (verify, glue, tree, step, AR's greedy round; not prefill) as
        CUDA graphs (``saguaro.lower.cuda_graphs``: one replay instead of hundreds of Python kernel launches
        per call, so two lanes do not contend for the GIL): True (CUDA only: on another device
        ``saguaro.compile`` raises a ``ConfigError`` naming it), False (off), or ``"auto"``, the default: on
        when the models are on CUDA (``saguaro.lower.cuda_graphs.CUDA_GRAPHS_AUTO``), off elsewhere and
        under ``tensor_parallel`` (all-reduces inside captured graphs are not yet run on GPUs). Each
        graph's first replay is compared bit for bit with the stage run without it; a stage whose replay
        differs runs without graphs from then on (``stats["graphs_off"]``, ``stats["plan"]``, a warning).
    lane_timeout_s: seconds the target waits for one answer of the draft lane, during a generation,
        before finishing that generation with SD.
    sd_when_faster: with ``fan_out="auto"``, an SSD generation whose warm-up measures that no tree pays
        with the verify and the build timed while both run (on the lanes' share of the cores, one
        intra-op thread each on CPU; sharing one GPU) runs as plain SD instead (``stats["planned_sd"]``, ``stats["ran_as"] == "sd"``: "ran as SD" wherever it is
        shown); False always runs SSD's rounds (``--plan always-ssd`` on the command line).
    lane_start_timeout_s: seconds a process lane may take to start (a new Python process imports
        torch and Saguaro and captures the draft); past it the lane is given up for the Program's
        life (until ``close()``) and SSD uses the thread lane.
    draft_device: where the draft and its lane run: None (the draft's own device, which must be the
        target's), or a device of the target's type: on CPU only ``"cpu"``; with a CUDA target any CUDA
        device of the process (``"cuda:1"``), where ``saguaro.compile`` moves the draft (``draft.to``) and
        the thread lane runs it on a stream of that device, tensors crossing between the devices copied
        without blocking, ordered by CUDA events. Kept as a string (a ``torch.device`` as ``str(device)``).
    tensor_parallel: None (one process holds the target), or ``N >= 1``: under ``torch.distributed`` with
        ``N + 1`` ranks (``torchrun --nproc-per-node N+1``), ranks ``0..N-1`` hold the target's shards
        (the ``shard_tensor_parallel`` pass) and rank ``N`` the draft (``saguaro.runtime.tensor_parallel``).
    weights: the target's linear weights: ``"as-loaded"`` (the default), or weight-only ``"int8"`` / ``"int4"``
        (the ``quantize_weights`` pass; lossless with respect to the quantized target; see ``docs/api.md``).
    draft_weights: the draft's, the same choices; None (the default) takes ``weights``.
    weight_group_size: ``k`` per scale of the quantized weights; None: one scale per output column for int8,
        64 for int4.
    """

    k: int = 5
    mode: str = "sd"
    backend: str = "inductor"
    compile: str = "blocking"
    fallback: str = "auto"
    fan_out: object = "auto"
    fan_out_budget: int | None = None
    saguaro_c: float = 1.0
    max_seq_len: int | None = None
    lane: str = "auto"
    lane_timeout_s: float = 60.0
    lane_start_timeout_s: float = 120.0
    sd_when_faster: bool = True
    attention: str = "auto"
    linears: str = "auto"
    narrow_weights: bool = True
    cuda_graphs: object = "auto"
    draft_device: str | None = None
    draft_address: str | None = None
    draft_secret_file: str | None = None
    tensor_parallel: int | None = None
    weights: str = "as-loaded"
    draft_weights: str | None = None
    weight_group_size: int | None = None

    def __post_init__(self):
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise ConfigError(f"k={self.k!r} is not allowed: k must be an int in 1..{MAX_K}")
        if self.mode not in MODES:
            raise ConfigError(f"mode={self.mode!r} is not allowed: choose one of {', '.join(MODES)}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r} is not allowed: choose one of {', '.join(BACKENDS)}")
        if not isinstance(self.compile, str) or self.compile not in COMPILE_MODES:
            raise ConfigError(f"compile={self.compile!r} is not allowed: choose one of {', '.join(COMPILE_MODES)}")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"fallback={self.fallback!r} is not allowed: choose one of {', '.join(FALLBACKS)}")
        if self.fan_out_budget is not None and (not isinstance(self.fan_out_budget, int) or self.fan_out_budget < 1):
            raise ConfigError(f"fan_out_budget={self.fan_out_budget!r} is not allowed: it must be a positive int")
        self._check_fan_out()
        if not isinstance(self.saguaro_c, (int, float)) or not 0.0 < float(self.saguaro_c) <= 1.0:
            raise ConfigError(f"saguaro_c={self.saguaro_c!r} is not allowed: it must lie in (0, 1]")
        if self.lane not in LANES:
            raise ConfigError(f"lane={self.lane!r} is not allowed: choose one of {', '.join(LANES)}")
        if not isinstance(self.lane_timeout_s, (int, float)) or not self.lane_timeout_s > 0:
            raise ConfigError(f"lane_timeout_s={self.lane_timeout_s!r} is not allowed: it must be > 0 seconds")
        if not isinstance(self.sd_when_faster, bool):
            raise ConfigError(f"sd_when_faster={self.sd_when_faster!r} is not allowed: it must be True or False")
        start = self.lane_start_timeout_s
        if isinstance(start, bool) or not isinstance(start, (int, float)) or not start > 0:
            raise ConfigError(f"lane_start_timeout_s={start!r} is not allowed: it must be > 0 seconds")
        if self.attention not in ATTENTIONS:
            raise ConfigError(f"attention={self.attention!r} is not allowed: choose one of {', '.join(ATTENTIONS)}")
        if self.linears not in LINEARS:
            raise ConfigError(f"linears={self.linears!r} is not allowed: choose one of {', '.join(LINEARS)}")
        if not isinstance(self.narrow_weights, bool):
            raise ConfigError(f"narrow_weights={self.narrow_weights!r} is not allowed: it must be True or "
                              "False")
        graphs = self.cuda_graphs  # True, False or "auto"; not 1 or 0
        if not isinstance(graphs, bool) and not (isinstance(graphs, str) and graphs == "auto"):
            raise ConfigError(f"cuda_graphs={graphs!r} is not allowed: choose 'auto', True or False")
        if self.max_seq_len is not None and (not isinstance(self.max_seq_len, int) or self.max_seq_len < 2):
            raise ConfigError(f"max_seq_len={self.max_seq_len!r} is not allowed: it must be an int >= 2")
        self._check_draft_device()
        self._check_remote()
        self._check_weights()
        tp = self.tensor_parallel
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ConfigError(f"tensor_parallel={tp!r} is not allowed: use None or an int >= 1 (target ranks)")

    def _check_weights(self):
        for field, value, allowed in (("weights", self.weights, WEIGHTS),
                                      ("draft_weights", self.draft_weights, (None, *WEIGHTS))):
            if not (value is None or isinstance(value, str)) or value not in allowed:
                raise ConfigError(f"{field}={value!r} is not allowed: choose one of {', '.join(WEIGHTS)}"
                                  + (" (or None: as weights)" if None in allowed else ""))
        group = self.weight_group_size
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
            raise ConfigError(f"weight_group_size={group!r} is not allowed: use None or a positive int dividing "
                              "each quantized weight's width")

    def quantized(self, model: str) -> tuple[str, int | None] | None:
        """``(kind, group size)`` the ``model`` (``"target"`` or ``"draft"``) is quantized with; None: as loaded."""
        kind = self.weights if model == "target" or self.draft_weights is None else self.draft_weights
        return None if kind == "as-loaded" else (kind, self.weight_group_size)

    def _check_remote(self):
        """``lane="remote"`` and ``draft_address`` come together (``"auto"`` with an address is remote)."""
        address, secret = self.draft_address, self.draft_secret_file
        if address is not None and (not isinstance(address, str) or ":" not in address):
            raise ConfigError(f"draft_address={address!r} is not allowed: give 'HOST:PORT'")
        if secret is not None and not isinstance(secret, str):
            raise ConfigError(f"draft_secret_file={secret!r} is not allowed: give a file path (a str) or None")
        if address is not None and self.lane == "auto":
            object.__setattr__(self, "lane", "remote")
        if self.lane == "remote" and address is None:
            raise ConfigError("lane='remote' needs draft_address='HOST:PORT' (where `saguaro draft-server` listens)")
        if address is not None and self.lane != "remote":
            raise ConfigError(f"draft_address={address!r} is only for lane='remote' (or 'auto'), not lane={self.lane!r}")

    def _check_draft_device(self):
        """A torch device of type cpu or cuda, or None; which one the target allows, ``saguaro.compile``
        checks (it knows the target's device)."""
        value = self.draft_device
        if value is None:
            return
        allowed = "None (the target's device), 'cpu', 'cuda' or 'cuda:N'"
        text = str(value) if type(value).__name__ == "device" else value  # a torch.device, as its string
        parsed = _DEVICE.fullmatch(text) if isinstance(text, str) else None
        if parsed is None:
            raise ConfigError(f"draft_device={value!r} is not allowed: it is not a torch device; use {allowed}")
        if parsed.group(1) not in DRAFT_DEVICE_TYPES:
            raise ConfigError(f"draft_device={value!r} is not allowed: the draft runs on {allowed}")
        object.__setattr__(self, "draft_device", text)

    def _check_fan_out(self):
        f = self.fan_out
        if f in ("auto", "geometric"):
            return
        if isinstance(f, int) and not isinstance(f, bool):
            if f < 0:
                raise ConfigError(f"fan_out={f!r} is not allowed: an int fan-out must be >= 0 (0: no tree)")
            return
        if isinstance(f, (list, tuple)):
            if len(f) != self.k + 1 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in f):
                raise ConfigError(
                    f"fan_out={list(f)!r} is not allowed: a list fan-out needs k+1={self.k + 1} non-negative ints")
            return
        raise ConfigError(f"fan_out={f!r} is not allowed: use 'auto', 'geometric', an int, or a list of k+1 ints")

    @property
    def budget(self) -> int:
        """Total fan-out ``MQ`` (``fan_out_budget`` or ``3·(k+1)``)."""
        return self.fan_out_budget if self.fan_out_budget is not None else 3 * (self.k + 1)
