"""Decoders: the rounds of modes ``ar``, ``sd`` and ``ssd``, one module each, over a DecodeState.
SSD talks to the draft side only through ``runtime.lanes.DraftClient``.
May import runtime.lanes, runtime.draft, runtime.base, core and tensor_math."""

from saguaro.runtime.decode.ar import decode_ar
from saguaro.runtime.decode.sd import decode_sd
from saguaro.runtime.decode.ssd import decode_ssd

# every decoder: (target, draft, state, plan, first_tokens) -> None, after the prefill decided first_tokens
DECODERS = {"ar": decode_ar, "sd": decode_sd, "ssd": decode_ssd}

__all__ = ["DECODERS"]
