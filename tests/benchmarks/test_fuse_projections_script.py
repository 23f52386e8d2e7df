"""``benchmarks/parts/fuse_projections.py`` without its compiles (the A/B itself runs for minutes): its options, the
switch between the two programs, and that the joined program's builders ask for the pass."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "parts"))
import fuse_projections as script


def test_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as done:
        script.main(["--help"])
    assert done.value.code == 0
    assert "python benchmarks/parts/fuse_projections.py --threads 1" in capsys.readouterr().out


def test_the_switch_sends_generate_to_the_named_program():
    programs = {
        form: SimpleNamespace(generate=lambda *a, form=form, **k: (form, a, k)) for form in script.FORMS
    }
    switch = script.Switch(programs)
    assert switch.generate("ids", mode="ar") == ("apart", ("ids",), {"mode": "ar"})
    switch.form = "joined"
    assert switch.generate("ids")[0] == "joined"


def test_the_joined_program_builds_its_stages_with_the_pass(monkeypatch):
    import alternating
    import linear_as_reduction

    import saguaro

    made = []

    def compile_stub(target, draft, **config):
        runner = lambda: SimpleNamespace(build=SimpleNamespace(fuse_projections=None))
        made.append(SimpleNamespace(target=runner(), draft=runner(), close=lambda: None, config=config))
        return made[-1]

    monkeypatch.setattr(saguaro, "compile", compile_stub)
    monkeypatch.setattr(linear_as_reduction, "pair_and_prompts", lambda count, new: ("t", "d", [], []))
    monkeypatch.setattr(
        alternating,
        "alternate",
        lambda *a: ({(f, m): [1.0] for f in script.FORMS for m in ("ar", "sd")}, True),
    )
    assert script.main(["--passes", "1"]) == 0
    apart, joined = made
    assert apart.target.build.fuse_projections is None and apart.draft.build.fuse_projections is None
    assert joined.target.build.fuse_projections is True and joined.draft.build.fuse_projections is True
    assert joined.config["backend"] == "inductor"
