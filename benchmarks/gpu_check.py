"""GPU check: stage and round timings of Saguaro on Llama-3.1-8B / Llama-3.2-1B shapes.

Builds a random-weight target of Llama-3.1-8B's shape and a draft of Llama-3.2-1B's shape (bf16,
shared vocabulary of 128256), compiles them with Saguaro (Inductor by default) and reports, as JSON:
verify ms, glue ms, tree ms per depth, draft step ms, SD round ms and SSD round ms, and the kernels
Inductor generated (Triton on GPU, C++ on CPU). Weights are random, so acceptance and cache hits say
nothing about a trained pair: the figures are per call and per round. Stage times are CUDA-event
timed repeats of the stage's last call in a real generation (a stage rewrites the same slots with
the same values, so repeats are idempotent).

``--scale tiny --device cpu`` runs the same script on two tiny models (the test suite does, so the
script keeps working between GPU sessions). The JSON is rewritten after each phase, so a run stopped
by a time limit still leaves what it measured.

Usage: ``bash benchmarks/gpu_check.sh`` (GPU, under 8 minutes), or
``python benchmarks/gpu_check.py --scale tiny --device cpu --backend eager --json check.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("gpu_check")

COMMON = dict(num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
              rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001)
SHAPES = {
    "full": {  # Llama-3.1-8B target, Llama-3.2-1B draft
        "target": dict(COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       tie_word_embeddings=False),
        "draft": dict(COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      tie_word_embeddings=True),
    },
    "tiny": {  # the same structure (GQA 4:1, tied draft embeddings), small enough for a CPU test
        "target": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=1, vocab_size=512, tie_word_embeddings=False),
        "draft": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=1, vocab_size=512, tie_word_embeddings=True),
    },
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=sorted(SHAPES), default="full", help="model shapes (default full)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="weights dtype (default bfloat16)")
    p.add_argument("--backend", choices=["eager", "inductor"], default="inductor", help="default inductor")
    p.add_argument("--attention", choices=["auto", "op", "inline", "flex"], default="auto",
                   help="Saguaro's attention lowering (default auto)")
    p.add_argument("--k", type=int, default=5, help="speculation length (default 5)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per timed generation (default 64)")
    p.add_argument("--repeats", type=int, default=20, help="timed repeats per stage call (default 20)")
    p.add_argument("--target-layers", type=int, default=None,
                   help="override the target's layer count (default: the shape's; fewer compile faster)")
    p.add_argument("--draft-layers", type=int, default=None, help="override the draft's layer count")
    p.add_argument("--json", metavar="PATH", default="gpu_check.json", help="where to write the report")
    p.add_argument("--kernel-dir", metavar="DIR", default=None,
                   help="Inductor's cache folder, read for the generated kernels (default: a fresh one)")
    return p.parse_args(argv)


def write_report(path: Path, report: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)  # never a half-written report


def build_model(shape: dict, dtype, device, seed: int, max_positions: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=max_positions)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise in the target dtype: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.to(device=device, dtype=dtype).eval()


class StageRecorder:
    """Wraps ``ModelRunner.run`` to keep the last call of each stage; tree calls are kept per depth
    (``draft.tree_greedy@1`` .. ``@k``, counted from the round's glue)."""

    def __init__(self):
        from saguaro.runtime.base.model_runner import ModelRunner

        self.runner_cls, self.original, self.calls, self.depth = ModelRunner, ModelRunner.run, {}, 0
        recorder = self

        def run(runner, stage, store, *args, **kwargs):
            key = stage.qualified
            if stage.family == "glue":
                recorder.depth = 0
            elif stage.family == "tree":
                recorder.depth += 1
                key = f"{key}@{recorder.depth}"
            recorder.calls[key] = (runner, stage, store, args, kwargs)
            return recorder.original(runner, stage, store, *args, **kwargs)

        ModelRunner.run = run

    def restore(self):
        self.runner_cls.run = self.original


def time_call(runner, stage, store, args, kwargs, repeats: int, device) -> float:
    """Milliseconds per call: CUDA events on GPU, perf_counter on CPU; warm calls first."""
    import torch

    for _ in range(3):
        runner.run(stage, store, *args, **kwargs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            runner.run(stage, store, *args, **kwargs)
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / repeats
    started = time.perf_counter()
    for _ in range(repeats):
        runner.run(stage, store, *args, **kwargs)
    return 1000 * (time.perf_counter() - started) / repeats


def generated_kernels(folder: Path) -> dict:
    """Kernel names found in Inductor's generated code under ``folder``: Triton and C++."""
    triton, cpp = set(), set()
    if folder.is_dir():
        for path in folder.rglob("*"):
            if path.suffix not in (".py", ".cpp") or not path.is_file():
                continue
            text = path.read_text(errors="replace")
            if "@triton.jit" in text:
                triton.update(re.findall(r"^def (triton_\w+)\(", text, flags=re.MULTILINE))
            cpp.update(re.findall(r"\b(cpp_fused_\w+)\(", text))
    return {"triton": sorted(triton), "triton_count": len(triton), "cpp": sorted(cpp), "cpp_count": len(cpp)}


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    kernel_dir = Path(args.kernel_dir or tempfile.mkdtemp(prefix="saguaro_inductor_"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(kernel_dir))  # before torch compiles anything
    kernel_dir = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
    import saguaro
    from saguaro.core.stages import DRAFT_GLUE, DRAFT_STEP, TARGET_VERIFY

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device} is not allowed here: CUDA is not available "
                         "(use --device cpu --scale tiny for a CPU run)")
    dtype = getattr(torch, args.dtype)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    shapes = {role: dict(shape) for role, shape in SHAPES[args.scale].items()}
    for role, layers in (("target", args.target_layers), ("draft", args.draft_layers)):
        if layers is not None:
            if layers < 1:
                raise SystemExit(f"--{role}-layers {layers} is not allowed: it must be >= 1")
            shapes[role]["num_hidden_layers"] = layers
    report = {
        "config": vars(args) | {"kernel_dir": str(kernel_dir)},
        "machine": {"torch": torch.__version__, "device": torch.cuda.get_device_name(device)
                    if device.type == "cuda" else "cpu"},
        "shapes": shapes,
    }
    phase = time.perf_counter()
    max_positions = args.prompt_len + args.max_new_tokens + 64
    target = build_model(shapes["target"], dtype, device, 0, max_positions)
    draft = build_model(shapes["draft"], dtype, device, 1, max_positions)
    report["build_s"] = time.perf_counter() - phase
    log.info("built target and draft in %.1fs", report["build_s"])
    write_report(path, report)

    phase = time.perf_counter()
    program = saguaro.compile(target, draft, k=args.k, mode="ssd", backend=args.backend, lane="thread",
                              attention=args.attention)
    vocab = shapes["target"]["vocab_size"]
    prompt = torch.randint(3, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    recorder = StageRecorder()
    rounds = {}
    try:
        for mode in ("sd", "ssd"):  # the first generation of each mode compiles its stages
            program.generate(prompt, max_new_tokens=args.max_new_tokens, mode=mode, eos_token_id=None)
            log.info("%s: first generation (compile included) done at %.1fs", mode, time.perf_counter() - phase)
        report["compile_s"] = time.perf_counter() - phase
        report["kernels"] = generated_kernels(kernel_dir)
        write_report(path, report)
        for mode in ("sd", "ssd"):
            stats = program.generate(prompt, max_new_tokens=args.max_new_tokens, mode=mode, eos_token_id=None).stats
            rounds[mode] = {
                "round_ms": 1000 * (stats["wall_s"] - stats["prefill_s"]) / max(stats["rounds"], 1),
                "rounds": stats["rounds"], "tokens_per_s": stats["tokens_per_s"],
                "mean_accepted_len": stats["mean_accepted_len"],
            } | ({"cache_hit_rate": stats["cache_hit_rate"], "draft_wait_ms_per_round":
                  1000 * stats["draft_wait_s"] / max(stats["rounds"], 1)} if mode == "ssd" else {})
        report["rounds"] = rounds
        write_report(path, report)
    finally:
        recorder.restore()
        program.close()

    stage_ms = {}
    with torch.inference_mode():
        for key, (runner, stage, store, call_args, kwargs) in sorted(recorder.calls.items()):
            if stage.family == "prefill":
                continue
            stage_ms[key] = time_call(runner, stage, store, call_args, kwargs, args.repeats, device)
    tree = sorted((int(k.rsplit("@", 1)[1]), v) for k, v in stage_ms.items() if "@" in k)
    report["stage_ms"] = stage_ms
    report["verify_ms"] = stage_ms.get(TARGET_VERIFY.greedy.qualified)
    report["glue_ms"] = stage_ms.get(DRAFT_GLUE.qualified)
    report["tree_ms_per_depth"] = [v for _, v in tree]
    report["draft_step_ms"] = stage_ms.get(DRAFT_STEP.greedy.qualified)
    report["sd_round_ms"] = rounds["sd"]["round_ms"]
    report["ssd_round_ms"] = rounds["ssd"]["round_ms"]
    report["kernels"] = generated_kernels(kernel_dir)
    write_report(path, report)
    summary = {k: report[k] for k in ("verify_ms", "glue_ms", "tree_ms_per_depth", "draft_step_ms", "sd_round_ms",
                                      "ssd_round_ms", "compile_s")}
    sys.stdout.write(json.dumps(summary, indent=2) + "\n")
    sys.stdout.write(f"{report['kernels']['triton_count']} Triton and {report['kernels']['cpp_count']} C++ kernels "
                     f"generated; report: {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
