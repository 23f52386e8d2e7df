"""A short soak of ``saguaro serve`` (``benchmarks/serve/serve_soak.py`` on the tiny pair, SSD with its draft
lane in a process, about 20 s of load): faults injected (a disconnect, a malformed body, the lane's process
killed, a burst past the queue), every greedy answer exact, none lost, and the server's file descriptors,
threads and child processes back to their start after the load; SIGTERM then exits 0."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "serve"))
import serve_soak


@pytest.mark.heavy
def test_short_soak_with_faults_has_no_mismatch_no_loss_and_no_leak(tmp_path):
    args = serve_soak.parser().parse_args(
        [
            "--tiny",
            "--minutes",
            "0.35",
            "--fault-every",
            "2.5",
            "--sample-every",
            "5",
            "--clients",
            "3",
            "--threads",
            "1",
            "--max-queue",
            "8",
        ]
    )
    report = serve_soak.run_soak(args)
    assert report["mismatches"] == 0, report["mismatch_examples"]
    assert report["lost"] == 0, report["lost_examples"]
    assert report["unexpected_errors"] == 0, report["error_examples"]
    assert report["greedy_checked"] > 10
    assert all(report["fault_counts"][kind] >= 1 for kind in serve_soak.FAULTS), report["faults"]
    assert report["faults_failed"] == 0, report["faults"]
    assert report["statuses"].get("429", 0) >= 1  # the burst went past the queue
    assert next(f for f in report["faults"] if f["kind"] == "lane_kill")["killed"] >= 1
    assert report["server_counts"].get("saguaro_draft_lane_failures_total", 0) >= 1  # seen, logged, survived
    for resource in ("fds", "threads", "children"):
        assert report["growth"][resource] <= 0, (resource, report["samples"])
    assert report["server_exit"] == 0


def test_scripts_have_help(capsys):
    import serve_guidellm
    import serve_load

    for script in (serve_soak, serve_load, serve_guidellm):
        with pytest.raises(SystemExit) as done:
            script.parser().parse_args(["--help"])
        assert done.value.code == 0
        assert "--json" in capsys.readouterr().out


def test_the_load_scripts_sampled_and_schema_fields_go_on_every_request(tmp_path):
    import serve_load

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    args = serve_load.parser().parse_args(
        ["--temperature", "0.7", "--top-p", "0.9", "--json-schema", str(schema)]
    )
    assert serve_load.fixed_fields(args) == {
        "temperature": 0.7,
        "top_p": 0.9,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "load", "schema": {"type": "object"}},
        },
    }
    assert serve_load.fixed_fields(serve_load.parser().parse_args([])) == {}  # the greedy and seeded mix


def test_the_load_script_sets_each_mode_against_ar_of_its_own_repetition():
    import serve_load

    rows = [
        {"mode": mode, "repetition": rep, "clients": 16, "output_tokens_per_s": tok_s}
        for rep, mode, tok_s in [
            (0, "ar", 100.0),
            (0, "sd", 120.0),
            (1, "ar", 50.0),
            (1, "sd", 55.0),
            (1, "ssd", 40.0),
        ]
    ]
    rows.append(
        {"mode": "sd", "repetition": 2, "clients": 16, "output_tokens_per_s": 9.0}
    )  # no AR to set it by
    assert serve_load.ratios_to_ar(rows) == {("sd", 16): [1.2, 1.1], ("ssd", 16): [0.8]}


def test_the_load_script_counts_the_stage_compiles_a_server_logged():
    from serve_common import slow_compiles

    log = [
        "18:41:46 INFO saguaro.lower.progress: compiling stage draft.step_sampled with inductor",
        "18:41:46 INFO saguaro.lower.progress: stage draft.step_sampled compiled in 0.0s (call 76)",  # a key covered
        "18:41:58 INFO saguaro.lower.progress: stage target.prefill compiled in 12.4s (call 1)",
        "18:42:09 INFO saguaro.lower.lowering: stage draft.step_sampled: call 90 (compile included) took 1.3s",
        "18:42:10 WARNING saguaro.serve: a request's prefill failed",
    ]
    assert slow_compiles(log) == 2
