"""How a row's timed passes combine: median tokens/s, spread, pooled counts; the interleaving order."""

import pytest
import torch

from saguaro.bench.passes import TimedPass, add_speedups, combine, interleaved


def timed(tokens: int, seconds: float, start: float) -> TimedPass:
    return TimedPass(started=start, ended=start + seconds, new_tokens=tokens, wall_s=seconds)


def test_a_row_reports_the_median_and_spread_of_its_passes():
    assert interleaved(["ar", "sd", "ssd"], 2) == ["ar", "sd", "ssd", "ar", "sd", "ssd"]
    row = combine(
        "hf", [timed(16, 2.0, 0.0), timed(16, 1.0, 5.0), timed(16, 4.0, 9.0)]
    )  # 8, 16 and 4 tokens/s
    assert row["tokens_per_s_reps"] == [8.0, 16.0, 4.0] and row["tokens_per_s"] == 8.0 and row["repeats"] == 3
    assert row["spread_pct"] == pytest.approx(100 * (16 - 4) / 8)
    assert row["new_tokens"] == 48 and row["wall_s"] == 7.0
    assert row["pass_times"] == [[0.0, 2.0], [5.0, 6.0], [9.0, 13.0]]
    assert (
        row["mean_accepted_len"] is None and row["round_ms_p50"] is None
    )  # transformers rounds are not counted
    alone = combine("sd", [timed(16, 2.0, 0.0)])
    assert alone["tokens_per_s"] == 8.0 and alone["spread_pct"] is None  # one pass: no spread
    rows = [row, alone]
    add_speedups(rows, ar=("ar",), sd=("sd",))
    assert [r["speedup_vs_sd"] for r in rows] == [1.0, 1.0] and [r["speedup_vs_ar"] for r in rows] == [
        None,
        None,
    ]


def test_the_rate_after_the_prefill_leaves_out_each_call_s_prefill_and_first_tokens():
    class Out:  # a generation of 2 rows: 0.5 s of its wall in the prefill
        stats = {"prefill_s": 0.5}
        sequences = torch.zeros(2, 11)

    first, second = TimedPass(), TimedPass()
    first.add(22, 2.5, Out())  # the prefill decides 2 of the 22 tokens: 20 in 2.0 s after it
    second.add(22, 4.5, Out())  # 20 in 4.0 s
    row = combine("sd", [first, second])
    assert row["decode_tokens_per_s_reps"] == [10.0, 5.0] and row["decode_tokens_per_s"] == 7.5
    assert row["tokens_per_s_reps"] == [22 / 2.5, 22 / 4.5]
    transformers = combine("hf", [timed(16, 2.0, 0.0)])  # no prefill times: no rate after it
    assert transformers["decode_tokens_per_s"] is None


def test_the_table_says_the_machine_was_busy_when_a_mode_s_passes_spread_over_25_percent():
    from saguaro.bench.report import BUSY_SPREAD_PCT, busy_note, busy_rows, format_table

    quiet = combine(
        "ar", [timed(16, 2.0, 0.0), timed(16, 2.2, 3.0), timed(16, 1.9, 6.0)]
    )  # 8.0, 7.3, 8.4: 14 %
    noisy = combine("ssd", [timed(16, 2.0, 1.0), timed(16, 1.0, 4.0), timed(16, 4.0, 7.0)])  # 150 %
    assert quiet["spread_pct"] < BUSY_SPREAD_PCT < noisy["spread_pct"]
    assert busy_rows([quiet]) == [] and busy_note([quiet]) is None
    assert "busy" not in format_table([quiet])
    assert busy_rows([quiet, noisy]) == ["ssd"]
    lines = format_table([quiet, noisy]).splitlines()
    assert len(lines) == 5 and lines[-1] == busy_note([quiet, noisy])
    assert lines[-1].startswith("The machine was busy: the timed passes of ssd spread over 25% (up to 150%)")
    assert "not to be trusted" in lines[-1]
    edge = dict(quiet, spread_pct=BUSY_SPREAD_PCT)  # at the limit: not over it
    assert busy_rows([edge]) == [] and busy_rows([dict(quiet, spread_pct=None)]) == []
