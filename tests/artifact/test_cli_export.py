"""``saguaro export OUT`` then ``saguaro generate --program OUT`` and ``saguaro bench --program OUT``:
the loaded program prints the target's greedy completion (the portable form: no native compile, so
the test stays fast; ``test_artifact.py`` covers the AOTInductor packages)."""

import pytest
import torch

from saguaro.cli.main import main
from saguaro.runtime.program import Program
from tests.models import EOS, reference_greedy, tiny_target
from tests.tiny_tokenizer import tiny_tokenizer

PROMPT = "def f(x):"


def run_cli(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_export_then_generate_and_bench_from_the_program(tmp_path, capsys, monkeypatch):
    target = tiny_target("llama", logit_scale=4.0)
    target.save_pretrained(tmp_path / "target")
    tiny_tokenizer().save_pretrained(tmp_path / "target")
    out_dir = tmp_path / "program"
    rc, out, err = run_cli(
        [
            "export",
            str(out_dir),
            "--target",
            str(tmp_path / "target"),
            "--modes",
            "ar",
            "--no-sampling",
            "--portable",
            "--k",
            "2",
            "--backend",
            "eager",
        ],
        capsys,
    )
    assert rc == 0, err
    assert "[1/2] target.prefill: exported" in out and "[2/2] target.round_greedy: exported" in out
    assert out.splitlines()[-1].startswith("total ")
    rc, out, err = run_cli(
        ["generate", "--program", str(out_dir), "--prompt", PROMPT, "--mode", "ar", "--max-new-tokens", "10"],
        capsys,
    )
    assert rc == 0, err
    tok = tiny_tokenizer()
    ids = tok(PROMPT, return_tensors="pt").input_ids
    expected = reference_greedy(target, ids, torch.ones_like(ids), 10, eos_token_id=EOS)
    assert out.splitlines()[1] == PROMPT + tok.decode(expected[0, ids.shape[1] :], skip_special_tokens=True)
    rc, out, err = run_cli(
        ["bench", "--program", str(out_dir), "--modes", "ar", "--prompts", "2", "--max-new-tokens", "4"],
        capsys,
    )
    assert rc == 0, err
    assert any(line.startswith("ar ") for line in out.splitlines())
    assert any(
        line.startswith("prompts (fixed): ") for line in out.splitlines()
    )  # the artifact has a tokenizer; its pair is unknown
    # a run whose rows raise still closes the loaded program (its lane ends with the run)
    closed, real_close = [], Program.close
    monkeypatch.setattr(Program, "close", lambda self: (closed.append(self), real_close(self))[1])

    def failing_rows(*args, **kwargs):
        raise OSError("disk")

    monkeypatch.setattr("saguaro.bench.rows.run_rows", failing_rows)
    with pytest.raises(OSError, match="disk"):
        main(["bench", "--program", str(out_dir), "--modes", "ar", "--prompts", "2", "--max-new-tokens", "4"])
    assert len(closed) == 1


def test_program_with_target_is_refused(tmp_path, capsys):
    rc, _, err = run_cli(
        ["generate", "--program", str(tmp_path), "--target", str(tmp_path), "--prompt", "x"], capsys
    )
    assert rc == 2 and "--program DIR loads an exported program" in err


def test_missing_program_is_named(tmp_path, capsys):
    rc, _, err = run_cli(["generate", "--program", str(tmp_path / "none"), "--prompt", "x"], capsys)
    assert rc == 2 and "no such artifact directory" in err
