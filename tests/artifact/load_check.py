"""Run in a fresh process: load artifacts and generate with them; print one JSON line.

``python -m tests.artifact.load_check SPEC_JSON``: SPEC_JSON is a list of runs ``{"path", "mode",
"temperature", "lane"}``. Prints ``{"tokens": [...], "counters": {...}, "stages": {...}}``, the
counters being torch._dynamo's (capture and Inductor compile counts) after every run.
"""

import json
import sys

import torch


def main(spec: str) -> None:
    torch.set_num_threads(1)
    from torch._dynamo.utils import counters

    import saguaro
    from tests.models import prompts

    runs = json.loads(spec)
    programs, tokens = {}, []
    ids, mask = prompts(2, 7, seed=1, pad_rows={1: 2})
    for run in runs:
        if run["path"] not in programs:
            programs[run["path"]] = saguaro.load(run["path"])
        program = programs[run["path"]]
        if run.get("lane"):
            program = program.variant(lane=run["lane"])
        out = program.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=12,
            mode=run["mode"],
            temperature=run["temperature"],
            seed=3,
            eos_token_id=None,
        )
        tokens.append(out.sequences.tolist())
    kinds = {path: {q: s.kind for q, s in p.target.built_stages.items()} for path, p in programs.items()}
    for p in programs.values():
        p.close()
    print(
        json.dumps(
            {
                "tokens": tokens,
                "counters": {k: dict(v) for k, v in counters.items()},
                "kinds": {path: sorted(set(v.values())) for path, v in kinds.items()},
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
