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
    """Options of :func:`saguaro.compile`, checked when built (:class:`ConfigError`); detail: ``docs/api.md``.

    k: speculation length, an int in 1..:data:`MAX_K`; default 5.
    mode: one of :data:`MODES`: ``"ar"`` (the target alone), ``"sd"`` or ``"ssd"``; default ``"sd"``.
    backend: ``"inductor"`` (``torch.compile`` of each stage) or ``"eager"``; default ``"inductor"``.
    compile: when Inductor compiles a new shape: ``"blocking"`` or ``"background"``; default ``"blocking"``.
    fallback: an SSD cache miss's proposal: ``"neural"``, ``"fast"`` or ``"auto"``; default ``"auto"``.
    fan_out: SSD branches per position: ``"auto"``, ``"geometric"``, an int >= 0 or k+1 ints; default auto.
    fan_out_budget: total branches ``MQ``, a positive int (None: :attr:`budget`'s ``3·(k+1)``); default None.
    saguaro_c: Saguaro sampling's down-weighting constant in (0, 1], 1 turning it off; default 1.0.
    max_seq_len: most tokens per sequence, an int >= 2 (None: the target's maximum positions); default None.
    lane: SSD's draft side: ``"thread"``, ``"process"``, ``"remote"`` or ``"auto"``; default ``"auto"``.
    lane_timeout_s: seconds > 0 the target waits for one lane answer before finishing with SD; default 60.0.
    lane_start_timeout_s: seconds > 0 a process lane may take to start, else the thread lane; default 120.0.
    sd_when_faster: with ``fan_out="auto"``, run SD where the warm-up finds that no tree pays; default True.
    attention: one of :data:`ATTENTIONS` (``"auto"``: chosen by backend and device); default ``"auto"``.
    linears: the few-row stages' linears, one of :data:`LINEARS` (``"auto"``: by backend); default ``"auto"``.
    narrow_weights: hold float32 weights whose values are exactly 16-bit in that dtype; default True.
    cuda_graphs: True (CUDA only), False, or ``"auto"`` (on when the models are on CUDA); default ``"auto"``.
    draft_device: None (the target's device), ``"cpu"`` or ``"cuda[:N]"``, kept as a str; default None.
    draft_address: ``"HOST:PORT"`` of a draft server, only with ``lane="remote"`` or ``"auto"``; default None.
    draft_secret_file: the draft server's secret file (None: ``$SAGUARO_DRAFT_SECRET``); default None.
    tensor_parallel: None (one process) or ``N >= 1`` target ranks under ``torch.distributed``; default None.
    weights: the target's linear weights, one of :data:`WEIGHTS`; default ``"as-loaded"``.
    draft_weights: the draft's, one of :data:`WEIGHTS` or None (as ``weights``); default None.
    weight_group_size: ``k`` per quantization scale, a positive int (None: the pass's default); default None.
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
            raise ConfigError(
                f"compile={self.compile!r} is not allowed: choose one of {', '.join(COMPILE_MODES)}"
            )
        if self.fallback not in FALLBACKS:
            raise ConfigError(
                f"fallback={self.fallback!r} is not allowed: choose one of {', '.join(FALLBACKS)}"
            )
        if self.fan_out_budget is not None and (
            not isinstance(self.fan_out_budget, int) or self.fan_out_budget < 1
        ):
            raise ConfigError(
                f"fan_out_budget={self.fan_out_budget!r} is not allowed: it must be a positive int"
            )
        self._check_fan_out()
        if not isinstance(self.saguaro_c, (int, float)) or not 0.0 < float(self.saguaro_c) <= 1.0:
            raise ConfigError(f"saguaro_c={self.saguaro_c!r} is not allowed: it must lie in (0, 1]")
        if self.lane not in LANES:
            raise ConfigError(f"lane={self.lane!r} is not allowed: choose one of {', '.join(LANES)}")
        if not isinstance(self.lane_timeout_s, (int, float)) or not self.lane_timeout_s > 0:
            raise ConfigError(
                f"lane_timeout_s={self.lane_timeout_s!r} is not allowed: it must be > 0 seconds"
            )
        if not isinstance(self.sd_when_faster, bool):
            raise ConfigError(
                f"sd_when_faster={self.sd_when_faster!r} is not allowed: it must be True or False"
            )
        start = self.lane_start_timeout_s
        if isinstance(start, bool) or not isinstance(start, (int, float)) or not start > 0:
            raise ConfigError(f"lane_start_timeout_s={start!r} is not allowed: it must be > 0 seconds")
        if self.attention not in ATTENTIONS:
            raise ConfigError(
                f"attention={self.attention!r} is not allowed: choose one of {', '.join(ATTENTIONS)}"
            )
        if self.linears not in LINEARS:
            raise ConfigError(f"linears={self.linears!r} is not allowed: choose one of {', '.join(LINEARS)}")
        if not isinstance(self.narrow_weights, bool):
            raise ConfigError(
                f"narrow_weights={self.narrow_weights!r} is not allowed: it must be True or False"
            )
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
            raise ConfigError(
                f"tensor_parallel={tp!r} is not allowed: use None or an int >= 1 (target ranks)"
            )

    def _check_weights(self):
        for field, value, allowed in (
            ("weights", self.weights, WEIGHTS),
            ("draft_weights", self.draft_weights, (None, *WEIGHTS)),
        ):
            if not (value is None or isinstance(value, str)) or value not in allowed:
                raise ConfigError(
                    f"{field}={value!r} is not allowed: choose one of {', '.join(WEIGHTS)}"
                    + (" (or None: as weights)" if None in allowed else "")
                )
        group = self.weight_group_size
        if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
            raise ConfigError(
                f"weight_group_size={group!r} is not allowed: use None or a positive int dividing "
                "each quantized weight's width"
            )

    def quantized(self, model: str) -> tuple[str, int | None] | None:
        """``(kind, group size)`` that ``model`` (``"target"`` or ``"draft"``) is quantized with, or None."""
        kind = self.weights if model == "target" or self.draft_weights is None else self.draft_weights
        return None if kind == "as-loaded" else (kind, self.weight_group_size)

    def _check_remote(self):
        """``lane="remote"`` and ``draft_address`` come together (``"auto"`` with an address is remote)."""
        address, secret = self.draft_address, self.draft_secret_file
        if address is not None and (not isinstance(address, str) or ":" not in address):
            raise ConfigError(f"draft_address={address!r} is not allowed: give 'HOST:PORT'")
        if secret is not None and not isinstance(secret, str):
            raise ConfigError(
                f"draft_secret_file={secret!r} is not allowed: give a file path (a str) or None"
            )
        if address is not None and self.lane == "auto":
            object.__setattr__(self, "lane", "remote")
        if self.lane == "remote" and address is None:
            raise ConfigError(
                "lane='remote' needs draft_address='HOST:PORT' (where `saguaro draft-server` listens)"
            )
        if address is not None and self.lane != "remote":
            raise ConfigError(
                f"draft_address={address!r} is only for lane='remote' (or 'auto'), not lane={self.lane!r}"
            )

    def _check_draft_device(self):
        """None, or a cpu or cuda device kept as its str (``saguaro.compile`` checks it for the target)."""
        value = self.draft_device
        if value is None:
            return
        allowed = "None (the target's device), 'cpu', 'cuda' or 'cuda:N'"
        text = str(value) if type(value).__name__ == "device" else value  # a torch.device, as its string
        parsed = _DEVICE.fullmatch(text) if isinstance(text, str) else None
        if parsed is None:
            raise ConfigError(
                f"draft_device={value!r} is not allowed: it is not a torch device; use {allowed}"
            )
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
            if len(f) != self.k + 1 or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in f
            ):
                raise ConfigError(
                    f"fan_out={list(f)!r} is not allowed: a list fan-out needs k+1={self.k + 1} non-negative ints"
                )
            return
        raise ConfigError(
            f"fan_out={f!r} is not allowed: use 'auto', 'geometric', an int, or a list of k+1 ints"
        )

    @property
    def budget(self) -> int:
        """Total fan-out ``MQ`` (``fan_out_budget`` or ``3·(k+1)``)."""
        return self.fan_out_budget if self.fan_out_budget is not None else 3 * (self.k + 1)
