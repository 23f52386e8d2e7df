"""``saguaro serve`` as a process: it prints its address when ready, SIGTERM stops it accepting, finishes
the request in flight (the exact answer, to ``data: [DONE]``) and exits 0; a non-loopback host without a
key is refused before any model loads."""

import os
import re
import signal
import subprocess
import sys

import httpx
import pytest

from saguaro.cli import main
from tests.conftest import tiny_program
from tests.models import tiny_target, truncated_draft
from tests.serve.server_util import solo
from tests.tiny_tokenizer import tiny_tokenizer

READY = re.compile(r"^saguaro serve: (\S+) at http://127\.0\.0\.1:(\d+)/v1")


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    """The weights of ``tiny_pair("llama")`` saved, the tokenizer beside the target."""
    root = tmp_path_factory.mktemp("serve_pair")
    target = tiny_target("llama")
    truncated_draft(target).save_pretrained(root / "draft")
    target.save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    return str(root / "target"), str(root / "draft")


def serve_process(target_dir, draft_dir, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    code = "import sys; from saguaro.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "serve",
            "--target",
            target_dir,
            "--draft",
            draft_dir,
            "--backend",
            "eager",
            "--mode",
            "sd",
            "--port",
            "0",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.mark.heavy
def test_sigterm_finishes_the_request_in_flight_then_exits(saved_pair):
    proc = serve_process(*saved_pair)
    try:
        line = proc.stdout.readline()
        ready = READY.match(line)
        assert ready, (line, proc.stderr.read() if proc.poll() is not None else "")
        assert ready.group(1) == "target"
        url = f"http://127.0.0.1:{ready.group(2)}/v1"
        body = {"prompt": "def f(x):", "max_tokens": 120, "temperature": 0, "stream": True}
        text = ""
        with httpx.stream("POST", url + "/completions", json=body, timeout=120) as stream:
            lines = stream.iter_lines()
            for raw in lines:
                if raw.startswith("data: {"):
                    text += httpx.Response(200, content=raw[6:]).json()["choices"][0]["text"]
                    break
            proc.send_signal(signal.SIGTERM)  # the request is in flight: its first chunk came, not its end
            rest = [raw for raw in lines if raw]
        assert rest[-1] == "data: [DONE]"
        text += "".join(httpx.Response(200, content=r[6:]).json()["choices"][0]["text"] for r in rest[:-1])
        assert proc.wait(timeout=120) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/models")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    _, _, program = tiny_program("llama", mode="sd")
    tokenizer = tiny_tokenizer()
    expected = solo(program, tokenizer("def f(x):").input_ids, 120)
    assert text == tokenizer.decode(expected, skip_special_tokens=True)


def test_a_non_loopback_host_without_a_key_exits_2_before_loading(capsys, monkeypatch):
    import saguaro.models_io

    monkeypatch.setattr(saguaro.models_io, "load_pair", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "'0.0.0.0' is not a loopback address" in err and "--api-key-file" in err


def test_an_empty_key_file_is_refused(tmp_path, capsys):
    (tmp_path / "key").write_text("\n")
    assert main(["serve", "--api-key-file", str(tmp_path / "key")]) == 2
    assert "is empty" in capsys.readouterr().err
