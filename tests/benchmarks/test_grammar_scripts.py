"""``benchmarks/parts/grammar_libraries.py`` (llguidance alone: the others are not installed) and
``grammar_speculation.py`` without a compile (its rows: each SD row beside its AR row, the grammar on the schema
rows)."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "parts"))
import grammar_libraries
import grammar_speculation

from saguaro import Grammar
from tests.tiny_tokenizer import tiny_tokenizer


def test_the_library_table_runs_for_llguidance(tmp_path, capsys):
    out = tmp_path / "libraries.json"
    grammar_libraries.main(["--reps", "1", "--libraries", "llguidance", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["schema"] for r in rows] == list(grammar_libraries.SCHEMAS)
    assert all(r["library"] == "llguidance" and r["mean_allowed"] >= 1 for r in rows)
    assert "llguidance" in capsys.readouterr().out


def test_the_speculation_rows_pair_each_sd_row_with_its_ar_row():
    grammar = Grammar.json_schema(grammar_speculation.SCHEMA, tiny_tokenizer())
    rows = grammar_speculation.rows(grammar)
    names = [name for name, *_ in rows]
    assert all(name.replace("sd ", "ar ", 1) in names for name in names if name.startswith("sd "))
    constrained = [controls for name, _, _, controls in rows if name.endswith("+schema")]
    assert len(constrained) == 4 and all(c["grammar"] is grammar for c in constrained)
    with pytest.raises(SystemExit):
        grammar_speculation.main(["--help"])
