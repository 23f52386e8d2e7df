"""``saguaro generate --trace``, ``saguaro inspect ...`` through ``saguaro.cli.main.main`` on a tiny saved
pair (``saguaro bench --trace``: ``tests/test_cli.py``'s bench run; ``tests/test_report.py`` renders the
report in a browser)."""

import json
import re

import pydot
import pytest

from saguaro.core.stages import STAGES
from saguaro.runtime.base.trace_read import check_trace, slices
from tests.test_cli import run_cli, saved_pair  # noqa: F401 - the fixture


def pair_args(saved_pair):  # noqa: F811
    target_dir, draft_dir = saved_pair
    return ["--target", target_dir, "--draft", draft_dir, "--k", "3", "--backend", "eager"]


def test_generate_writes_a_trace(saved_pair, capsys, tmp_path):  # noqa: F811
    path = tmp_path / "run.json"
    rc, out, err = run_cli(
        [
            "generate",
            "--prompt",
            "def f(x):",
            "--mode",
            "sd",
            "--max-new-tokens",
            "10",
            "--trace",
            str(path),
            *pair_args(saved_pair),
        ],
        capsys,
    )
    assert rc == 0, err
    assert f"wrote the timeline to {path}" in out
    trace = json.loads(path.read_text())
    check_trace(trace)
    assert {"target.prefill", "target.verify_round_greedy", "draft.chain_greedy"} <= {
        s.name for s in slices(trace)
    }


def test_inspect_passes_table_and_diff(saved_pair, capsys):  # noqa: F811
    rc, out, err = run_cli(["inspect", "passes", *pair_args(saved_pair)], capsys)
    assert rc == 0, err
    for stage in STAGES:
        assert re.search(rf"^{re.escape(stage.qualified)}\s+splice_epilogue\s+\d+\s+[+-]\d+$", out, re.M)
    rc, out, err = run_cli(
        [
            "inspect",
            "passes",
            "--stage",
            "verify_greedy",
            "--pass",
            "splice_epilogue",
            *pair_args(saved_pair),
        ],
        capsys,
    )
    assert rc == 0, err
    assert out.startswith("--- target.verify_greedy after specialize_attention") and "+def forward(" in out
    rc, out, err = run_cli(["inspect", "passes", "--pass", "splice_epilogue", *pair_args(saved_pair)], capsys)
    assert rc == 2 and "--pass needs --stage" in err


def test_inspect_graph_writes_dot(saved_pair, capsys, tmp_path):  # noqa: F811
    out_file = tmp_path / "view.dot"
    rc, out, err = run_cli(
        ["inspect", "graph", "draft.glue", "--format", "dot", "--out", str(out_file), *pair_args(saved_pair)],
        capsys,
    )
    assert rc == 0, err
    assert f"wrote {out_file}" in out and pydot.graph_from_dot_data(out_file.read_text())


def test_inspect_graph_names_a_bad_stage(saved_pair, capsys):  # noqa: F811
    rc, out, err = run_cli(["inspect", "graph", "target.nope", *pair_args(saved_pair)], capsys)
    assert rc == 2 and "target.nope" in err and "target.verify_greedy" in err


def test_inspect_weights_prints_each_model_s_bytes_by_form(saved_pair, capsys):  # noqa: F811
    rc, out, err = run_cli(["inspect", "weights", "--mode", "sd", *pair_args(saved_pair)], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split() == ["model", "form", "MiB"]
    forms = {(line.split()[0], " ".join(line.split()[1:-1])): float(line.split()[-1]) for line in lines[1:-1]}
    assert (
        forms[("target", "as loaded")] > 0 and forms[("draft", "as loaded")] > 0
    )  # eager: the float32 weights
    assert lines[-1].split()[0] == "total" and float(lines[-1].split()[1]) == pytest.approx(
        sum(forms.values()), abs=0.02
    )
