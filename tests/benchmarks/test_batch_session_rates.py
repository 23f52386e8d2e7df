"""``benchmarks/parts/batch_session_rates.py`` on the default pair, eager, a few tokens: every case runs, SD's
beside its AR's, and the table and JSON say what it measured."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "parts"))
import batch_session_rates


def test_every_case_runs_and_is_set_beside_its_ar_case(tmp_path, caplog):
    out = tmp_path / "rates.json"
    with caplog.at_level("INFO", logger="batch_session_rates"):
        rows = batch_session_rates.main(
            [
                "--backend",
                "eager",
                "--rows",
                "1,2",
                "--reps",
                "1",
                "--max-new-tokens",
                "4",
                "--json",
                str(out),
            ]
        )
    assert [(r["mode"], r["kind"], r["rows"]) for r in rows] == batch_session_rates.cases([1, 2])
    assert all(
        r["tokens_per_s"] > 0 and 0 < r["tokens_a_row_a_round"] <= 5 + 1 for r in rows
    )  # k + 1 at most
    assert all(r["tokens_a_row_a_round"] <= 1 for r in rows if r["mode"] == "ar")  # a token a step (a row's
    # last step may bring none: it ends there)
    assert all(r["vs_ar"] == 1.0 for r in rows if r["mode"] == "ar")
    assert all(set(r["ks"]) == {"5"} for r in rows if r["mode"] == "sd-fixed")  # the program's k, every round
    assert all(r["ks"] and {int(k) for k in r["ks"]} <= set(range(1, 6)) for r in rows if r["mode"] == "sd")
    assert all(not r["ks"] for r in rows if r["mode"] == "ar")
    assert json.loads(out.read_text())["rows"] == rows
    assert "tokens/row/round" in caplog.text and "sampled" in caplog.text
