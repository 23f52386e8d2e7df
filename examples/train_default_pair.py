"""Train Saguaro's default (target, draft) pair on the Python standard library's own source.

Reproducible end to end: the corpus is the running interpreter's stdlib ``*.py`` files, the
held-out split is a fixed hash of each file's relative path, and every random choice is seeded.

Phases (each resumable from ``--workdir`` with ``--resume``):
  1. byte-level BPE tokenizer trained with ``tokenizers`` on the training files;
  2. target ``LlamaForCausalLM`` trained with next-token cross-entropy;
  3. draft ``LlamaForCausalLM`` (<= 1/8 of the target's FLOPs per token) distilled from the
     target's logits (KL at temperature ``--kd-temperature``, mixed with CE by ``--kd-alpha``);
  4. evaluation (held-out perplexity, greedy speculative acceptance at k, sample completions) of the
     float16-rounded weights, then export to ``--out/{target,draft}`` with the model card.

Example (the command that built the committed pair is in saguaro/assets/default/MODEL_CARD.md):
    nice -n 19 python examples/train_default_pair.py --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import platform
import shlex
import time
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers

REPO = Path(__file__).resolve().parents[1]
log = logging.getLogger("train_default_pair")


def _load_helpers():
    """Load ``saguaro/default_pair.py`` alone: the script needs only its corpus/eval helpers and
    must not depend on the rest of the package importing (compiler stack, optional backends)."""
    spec = importlib.util.spec_from_file_location(
        "_saguaro_default_pair", REPO / "saguaro" / "default_pair.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


dp = _load_helpers()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument(
        "--out",
        default=str(REPO / "saguaro" / "assets" / "default"),
        help="folder receiving target/, draft/, MODEL_CARD.md and heldout_eval.json",
    )
    g.add_argument(
        "--workdir",
        default=str(REPO / "runs" / "default_pair"),
        help="folder for checkpoints, the tokenizer and fp32 finals (git-ignored runs/)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoints and finished phases found in --workdir",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of every random choice")
    g.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    g.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="cap on the steps of each training phase (quick runs; overrides --*-steps)",
    )
    g.add_argument("--log-every", type=int, default=50, help="steps between progress lines")
    g.add_argument("--eval-every", type=int, default=400, help="steps between held-out evaluations")
    g.add_argument("--ckpt-every", type=int, default=500, help="steps between checkpoints")
    g.add_argument(
        "--autocast",
        choices=["bf16", "none"],
        default="bf16",
        help="CPU autocast for target training and teacher forwards (bf16 uses AMX/AVX512)",
    )

    g = p.add_argument_group("corpus and tokenizer")
    g.add_argument("--stdlib", default=None, help="corpus root (default: this interpreter's stdlib)")
    g.add_argument("--max-file-bytes", type=int, default=dp.MAX_FILE_BYTES, help="skip larger files")
    g.add_argument(
        "--heldout-percent",
        type=int,
        default=dp.HELDOUT_PERCENT,
        help="held out iff int(sha1(relpath),16) %% 100 < this",
    )
    g.add_argument(
        "--max-files", type=int, default=0, help="use only this many training files (0: all; quick runs)"
    )
    g.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    g.add_argument("--seq-len", type=int, default=256, help="training context length")

    g = p.add_argument_group("target model and training")
    g.add_argument("--target-layers", type=int, default=6, help="target decoder layers")
    g.add_argument("--target-hidden", type=int, default=384, help="target hidden size")
    g.add_argument("--target-heads", type=int, default=6, help="target attention heads")
    g.add_argument("--target-intermediate", type=int, default=1024, help="target MLP size")
    g.add_argument("--target-steps", type=int, default=4000, help="target optimizer steps")
    g.add_argument("--target-batch", type=int, default=16, help="target sequences per step")
    g.add_argument("--target-lr", type=float, default=1.5e-3, help="target peak learning rate")

    g = p.add_argument_group("draft model and distillation")
    g.add_argument("--draft-layers", type=int, default=4, help="draft decoder layers")
    g.add_argument("--draft-hidden", type=int, default=128, help="draft hidden size")
    g.add_argument("--draft-heads", type=int, default=4, help="draft attention heads")
    g.add_argument("--draft-intermediate", type=int, default=384, help="draft MLP size")
    g.add_argument("--draft-steps", type=int, default=1400, help="draft optimizer steps")
    g.add_argument("--draft-batch", type=int, default=16, help="draft sequences per step")
    g.add_argument("--draft-lr", type=float, default=3e-3, help="draft peak learning rate")
    g.add_argument(
        "--kd-alpha",
        type=float,
        default=1.0,
        help="draft loss = alpha*KL(target||draft) + (1-alpha)*CE; 0 trains on data only",
    )
    g.add_argument("--kd-temperature", type=float, default=1.0, help="distillation temperature")
    g.add_argument(
        "--max-flops-ratio",
        type=float,
        default=1 / 8,
        help="assert draft FLOPs/token <= this times the target's",
    )

    g = p.add_argument_group("optimizer (both phases)")
    g.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to this * peak")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    g.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip")

    g = p.add_argument_group("evaluation")
    g.add_argument("--eval-chunks", type=int, default=32, help="held-out slice: number of chunks")
    g.add_argument("--eval-len", type=int, default=256, help="held-out slice: chunk length")
    g.add_argument("--k", type=int, default=5, help="speculation length for the acceptance estimate")
    g.add_argument("--accept-prompts", type=int, default=64, help="held-out prompts for acceptance")
    g.add_argument("--accept-prompt-len", type=int, default=64, help="tokens per acceptance prompt")
    g.add_argument("--accept-new-tokens", type=int, default=128, help="tokens generated per prompt")
    g.add_argument("--sample-new-tokens", type=int, default=64, help="tokens per sample completion")
    return p


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def canonical_command(args) -> str:
    """The command that reproduces this run: the options that differ from their defaults
    (``--resume`` excluded: resuming does not change the result)."""
    parts = ["nice -n 19 python examples/train_default_pair.py"]
    for action in build_parser()._actions:
        if not action.option_strings or action.dest in ("help", "resume"):
            continue
        value = getattr(args, action.dest)
        if value != action.default:
            flag = action.option_strings[0]
            parts.append(flag if isinstance(value, bool) else f"{flag} {shlex.quote(str(value))}")
    return " ".join(parts)


# ----------------------------------------------------------------------------------------------
# data


def build_tokenizer(texts, vocab_size, model_max_length):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    eos, pad = "<|endoftext|>", "<|pad|>"
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos, pad],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer=trainer)
    # tokenizer(text) starts with eos, as every training file does: "start of a file".
    tk.post_processor = processors.TemplateProcessing(
        single=f"{eos} $A", pair=f"{eos} $A {eos} $B", special_tokens=[(eos, tk.token_to_id(eos))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=eos,
        eos_token=eos,
        pad_token=pad,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def load_corpus(args):
    root = Path(args.stdlib) if args.stdlib else dp.stdlib_root()
    files = dp.corpus_files(root, args.max_file_bytes)
    train = [f for f in files if not dp.is_heldout(f, args.heldout_percent)]
    heldout = [f for f in files if dp.is_heldout(f, args.heldout_percent)]
    if args.max_files:
        # a spread-out subset: the first files in sha1 order, not the first folder alphabetically
        import hashlib

        train = sorted(sorted(train, key=lambda f: hashlib.sha1(f.encode()).hexdigest())[: args.max_files])
    texts = [t for t in (dp.read_source(root, f) for f in train) if t is not None]
    log.info(
        "corpus %s: %d files (%d train, %d held out), %d train texts, %.1f MB",
        root,
        len(files),
        len(train),
        len(heldout),
        len(texts),
        sum(map(len, texts)) / 1e6,
    )
    return root, train, heldout, texts


def encode_stream(tokenizer, texts):
    ids = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.append(tokenizer.eos_token_id)
        ids.extend(enc)
    return torch.tensor(ids, dtype=torch.int32)


def sample_batch(stream, batch, seq_len, gen):
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
    return stream[idx].long()  # [B, L+1]


# ----------------------------------------------------------------------------------------------
# models and training


def make_model(vocab, layers, hidden, heads, intermediate, seq_len, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def lr_at(step, total, peak, warmup, min_ratio):
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_phase(name, model, stream, eval_chunks, args, steps, batch, lr, seed, teacher=None, autocast=False):
    """Train ``model`` for ``steps``; resumable from ``workdir/{name}.ckpt``. Returns the model."""
    ckpt_path = Path(args.workdir) / f"{name}.ckpt"
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(seed)
    step = 0
    if args.resume and ckpt_path.is_file():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        step = ck["step"]
        log.info("%s: resumed at step %d from %s", name, step, ckpt_path)

    def save():
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save(
            {"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step}, tmp
        )
        os.replace(tmp, ckpt_path)

    def evaluate():
        model.eval()
        msg = f"{name} step {step}: held-out ppl {dp.perplexity(model, eval_chunks):.3f}"
        if teacher is not None:
            msg += f", teacher-forced greedy agreement {greedy_agreement(teacher, model, eval_chunks):.4f}"
        log.info(msg)
        model.train()

    tokens_per_step = batch * args.seq_len
    model.train()
    t0, step0, loss_sum, loss_n = time.time(), step, 0.0, 0
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, args.warmup, args.min_lr_ratio)
        xy = sample_batch(stream, batch, args.seq_len, gen)
        x, y = xy[:, :-1], xy[:, 1:]  # [B, L]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x).logits  # [B, L, V]
        logits = logits.float().reshape(-1, logits.shape[-1])
        ce = F.cross_entropy(logits, y.reshape(-1))
        if teacher is not None and args.kd_alpha > 0:
            with (
                torch.no_grad(),
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"),
            ):
                t_logits = teacher(input_ids=x).logits  # [B, L, V]
            t = args.kd_temperature
            t_logp = F.log_softmax(t_logits.float().reshape(-1, logits.shape[-1]) / t, dim=-1)
            s_logp = F.log_softmax(logits / t, dim=-1)
            kl = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean") * t * t
            loss = args.kd_alpha * kl + (1 - args.kd_alpha) * ce
        else:
            loss = ce
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        loss_sum += loss.item()
        loss_n += 1
        if step % args.log_every == 0 or step == steps:
            elapsed = time.time() - t0
            rate = (step - step0) * tokens_per_step / elapsed
            eta = (steps - step) * tokens_per_step / rate
            log.info(
                "%s step %d/%d loss %.4f (ce %.4f) lr %.2e | %.0f tok/s | elapsed %.0fs | ETA %.0fs",
                name,
                step,
                steps,
                loss_sum / loss_n,
                ce.item(),
                opt.param_groups[0]["lr"],
                rate,
                elapsed,
                eta,
            )
            loss_sum, loss_n = 0.0, 0
        if step % args.ckpt_every == 0 or step == steps:
            save()
        if step % args.eval_every == 0 and step != steps:
            evaluate()
    model.eval()
    return model


# ----------------------------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def greedy_agreement(target, draft, chunks, batch_size=8):
    """Fraction of positions where draft and target argmax agree, teacher-forced on ``chunks``."""
    agree, count = 0, 0
    for s in range(0, chunks.shape[0], batch_size):
        b = chunks[s : s + batch_size]
        agree += (target(input_ids=b).logits.argmax(-1) == draft(input_ids=b).logits.argmax(-1)).sum().item()
        count += b.numel()
    return agree / count


@torch.no_grad()
def speculative_acceptance(target, draft, prompts, new_tokens, k):
    """Greedy speculative decoding's mean accepted length (tokens per target call, bonus included).

    Greedy SD emits exactly the target's greedy continuation, and while the draft's proposals
    match it, the draft's context is that continuation; so a round starting at position p accepts
    ``a`` = the number of consecutive positions p, p+1, .. (at most k) where the draft's argmax
    given the target's greedy prefix equals the target's token, then emits ``a + 1`` tokens. One
    teacher-forced draft forward over the target's continuation gives every such argmax.
    """
    from transformers import GenerationConfig

    gc = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=target.config.pad_token_id,
    )
    seqs = target.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=gc)
    plen = prompts.shape[1]
    pred = draft(input_ids=seqs[:, :-1]).logits.argmax(-1)  # [P, T-1]; pred[:, j] guesses seqs[:, j+1]
    match = (pred[:, plen - 1 :] == seqs[:, plen:]).tolist()  # [P, new_tokens]
    rounds, emitted, hist = 0, 0, [0] * (k + 1)
    for row in match:
        p = 0
        while p < len(row):
            a = 0
            while a < k and p + a < len(row) and row[p + a]:
                a += 1
            rounds += 1
            emitted += a + 1
            hist[a] += 1
            p += a + 1
    flat = [m for row in match for m in row]
    return {
        "mean_accepted_len": emitted / rounds,
        "rounds": rounds,
        "token_agreement": sum(flat) / len(flat),
        "accepted_hist": hist,
    }


def acceptance_prompts(heldout_stream, n, length, seed):
    gen = torch.Generator().manual_seed(seed + 7)
    starts = torch.randint(0, heldout_stream.numel() - length, (n,), generator=gen)
    return torch.stack([heldout_stream[s : s + length] for s in starts.tolist()]).long()


@torch.no_grad()
def complete(model, tokenizer, prompt, new_tokens):
    """Greedy completion. A prompt ending in spaces is tokenized unnaturally for byte-level BPE
    (a space is normally fused to the next word), so the trailing spaces are dropped and the first
    token is restricted to tokens starting with them ("token healing"); the output is unchanged."""
    stripped = prompt.rstrip(" ")
    tail = prompt[len(stripped) :]
    ids = tokenizer(stripped, return_tensors="pt")["input_ids"]
    allowed = None
    if tail:
        vocab = [tokenizer.decode([i]) for i in range(len(tokenizer))]
        allowed = torch.tensor([v.startswith(tail) and len(v) > 0 for v in vocab])
    for i in range(new_tokens):
        logits = model(input_ids=ids).logits[0, -1]
        if i == 0 and allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        nxt = int(logits.argmax())
        if nxt == tokenizer.eos_token_id:
            break
        ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        if ids.shape[1] >= model.config.max_position_embeddings:
            break
    return tokenizer.decode(ids[0], skip_special_tokens=True)


def write_model_card(out: Path, r: dict) -> None:
    """Render ``MODEL_CARD.md`` from the run's results (every number below comes from ``r``)."""
    a = r["args"]
    acc = r["acceptance"]
    tt = r["train_time_s"]
    hist = ", ".join(f"{i}: {n}" for i, n in enumerate(acc["accepted_hist"]))
    samples = "\n\n".join(f"Prompt `{p!r}`:\n\n```python\n{s}\n```" for p, s in r["samples"].items())
    text = f"""# Saguaro default model pair

A small Llama **target** and a much smaller Llama **draft** sharing one tokenizer, trained from
scratch by the project on the Python standard library's own source, so that Saguaro has a real,
license-clean model pair to test and benchmark speculative decoding with, offline. They complete
Python-looking code; they are not useful code assistants.

Load with `target, draft, tokenizer = saguaro.default_pair()` (float32 by default; the weights are
stored in float16).

## Corpus and split

- Every `*.py` file under `sysconfig.get_paths()["stdlib"]` of CPython {r["python_version"]}
  (tests included), except those under `site-packages` or `__pycache__`, files larger than
  {a["max_file_bytes"]} bytes, and files that are not UTF-8: {r["train_files"]} training files and
  {r["heldout_files"]} held-out files.
- **Held-out rule**: a file is held out iff `int(sha1(relpath).hexdigest(), 16) % 100 < {a["heldout_percent"]}`,
  `relpath` being its POSIX path relative to the stdlib folder (`saguaro.default_pair.is_heldout`).
- Each file is tokenized as `[eos] + ids(text)`; the training files are concatenated into one
  stream of {r["train_tokens"]:,} tokens, and batches are random windows of it.

## Tokenizer

Byte-level BPE (`tokenizers`, GPT-2 pre-tokenization, no prefix space) with {r["vocab_size"]} tokens,
trained on the training files. `<|endoftext|>` (id {r["eos_id"]}) is bos, eos and the file separator;
`<|pad|>` (id {r["pad_id"]}) pads. `tokenizer(text)` prepends `<|endoftext|>`, meaning "start of a file".
As with every byte-level BPE, a space is fused to the word after it, so a prompt ending in a
space (`"def "`) is tokenized unlike anything seen in training; drop the trailing space or heal it
(the samples below restrict the first generated token to tokens starting with the dropped spaces).

## Models

| | layers | hidden | heads | MLP | context | parameters | FLOPs/token |
|---|---|---|---|---|---|---|---|
| target | {a["target_layers"]} | {a["target_hidden"]} | {a["target_heads"]} | {a["target_intermediate"]} | {a["seq_len"]} | {r["target_params"]:,} | {r["target_flops_per_token"]:,} |
| draft | {a["draft_layers"]} | {a["draft_hidden"]} | {a["draft_heads"]} | {a["draft_intermediate"]} | {a["seq_len"]} | {r["draft_params"]:,} | {r["draft_flops_per_token"]:,} |

`LlamaForCausalLM`, tied input/output embeddings, RoPE, trained at context {a["seq_len"]}
(`max_position_embeddings`; longer sequences run but are out of distribution). FLOPs/token is
`2 * (non-embedding parameters + V * d)` (`saguaro.default_pair.flops_per_token`; attention
scores excluded): the draft costs **{r["flops_ratio"]:.4f}** of the target (limit 1/8 = 0.125).

## Training

- Target: {r["steps"]["target"]} AdamW steps of {a["target_batch"]} x {a["seq_len"]} tokens, next-token
  cross-entropy, peak lr {a["target_lr"]}, {a["warmup"]} warmup steps then cosine to
  {a["min_lr_ratio"]} x peak, weight decay {a["weight_decay"]}, grad clip {a["grad_clip"]},
  CPU autocast {a["autocast"]}.
- Draft: {r["steps"]["draft"]} steps of {a["draft_batch"]} x {a["seq_len"]} tokens, peak lr {a["draft_lr"]},
  same schedule, float32, distilled from the target's logits: loss = {a["kd_alpha"]} x
  KL(target || draft) at temperature {a["kd_temperature"]} + {1 - a["kd_alpha"]:.2g} x CE.
- Seed {a["seed"]}, {a["threads"]} torch threads on {r["hardware"]}, torch {r["torch_version"]},
  transformers {r["transformers_version"]}, tokenizers {r["tokenizers_version"]}.
- Wall-clock: target {tt.get("target", float("nan")) / 60:.1f} min, draft {tt.get("draft", float("nan")) / 60:.1f} min
  (machine shared with other work, at `nice 19`).
- Exact command (from the repository root; checkpoints go to `runs/default_pair/`, `--resume` continues):

```
{r["command"]}
```

## Held-out evaluation

All numbers are for the exported float16 weights loaded in float32.

- **Slice**: held-out files in sorted `relpath` order, each as `[eos] + ids(text)`, concatenated;
  the first {a["eval_chunks"]} x {a["eval_len"]} tokens cut into {a["eval_chunks"]} non-overlapping chunks of
  {a["eval_len"]} tokens, each scored on its own; perplexity = exp(mean NLL over every position but
  the first of each chunk) (`saguaro.default_pair.heldout_chunks` / `perplexity`; definition,
  token-id sha1 and expected values in `heldout_eval.json`, checked by `tests/test_default_pair.py`).
- **Perplexity**: target **{r["target_ppl"]:.3f}**, draft **{r["draft_ppl"]:.3f}**.
- Teacher-forced greedy agreement on the slice (draft argmax = target argmax): {r["teacher_forced_agreement"]:.4f}.
- **Greedy speculative decoding, k = {a["k"]}**: mean accepted length **{acc["mean_accepted_len"]:.3f}** tokens
  per target call (bonus included), per-token agreement {acc["token_agreement"]:.4f}, over
  {a["accept_prompts"]} held-out prompts of {a["accept_prompt_len"]} tokens (random windows of the
  held-out stream, seeded) each continued by {r["accept_new_tokens"]} tokens ({acc["rounds"]} rounds;
  rounds accepting 0..k drafts: {hist}). Measured exactly as greedy SD behaves: the target's greedy
  continuation is generated, then a round starting at position p accepts the longest run (at most
  k) of positions where the draft's argmax given that prefix equals the target's token, and emits
  one more token.

## Samples (target, greedy, {a["sample_new_tokens"]} new tokens at most)

{samples}

## Files

`target/` and `draft/`: `config.json`, `generation_config.json` (eos {r["eos_id"]}, pad {r["pad_id"]}),
`model.safetensors` (float16), tokenizer files (identical in both): {r["asset_bytes"] / 1e6:.1f} MB for the two folders.
"""
    (out / "MODEL_CARD.md").write_text(text)


# ----------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    work, out = Path(args.workdir), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    root, train_files, heldout_files, texts = load_corpus(args)

    tok_dir = work / "tokenizer"
    if args.resume and (tok_dir / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        log.info("tokenizer: loaded %s", tok_dir)
    else:
        tokenizer = build_tokenizer(texts, args.vocab_size, args.seq_len)
        tokenizer.save_pretrained(tok_dir)
        log.info("tokenizer: trained, vocab %d", len(tokenizer))
    stream = encode_stream(tokenizer, texts)
    log.info(
        "train stream: %d tokens (%.2f bytes/token)", stream.numel(), sum(map(len, texts)) / stream.numel()
    )
    eval_chunks = dp.heldout_chunks(
        tokenizer, args.eval_chunks, args.eval_len, root, args.heldout_percent, args.max_file_bytes
    )
    heldout_texts = [t for t in (dp.read_source(root, f) for f in heldout_files) if t is not None]
    heldout_stream = encode_stream(tokenizer, heldout_texts)

    cap = (lambda n: n) if args.max_steps is None else (lambda n: min(n, args.max_steps))
    vocab = len(tokenizer)
    target = make_model(
        vocab,
        args.target_layers,
        args.target_hidden,
        args.target_heads,
        args.target_intermediate,
        args.seq_len,
        tokenizer,
    )
    draft = make_model(
        vocab,
        args.draft_layers,
        args.draft_hidden,
        args.draft_heads,
        args.draft_intermediate,
        args.seq_len,
        tokenizer,
    )
    ft, fd = dp.flops_per_token(target), dp.flops_per_token(draft)
    n_t, n_d = sum(p.numel() for p in target.parameters()), sum(p.numel() for p in draft.parameters())
    log.info(
        "target: %d params, %.2f MFLOPs/token; draft: %d params, %.2f MFLOPs/token; ratio %.4f",
        n_t,
        ft / 1e6,
        n_d,
        fd / 1e6,
        fd / ft,
    )
    assert fd <= args.max_flops_ratio * ft, f"draft FLOPs ratio {fd / ft:.4f} > {args.max_flops_ratio}"

    times = {}
    for name, model, steps, batch, lr, teacher, ac in (
        (
            "target",
            target,
            cap(args.target_steps),
            args.target_batch,
            args.target_lr,
            None,
            args.autocast == "bf16",
        ),
        ("draft", draft, cap(args.draft_steps), args.draft_batch, args.draft_lr, "target", False),
    ):
        final = work / f"{name}_final"
        if args.resume and (final / "config.json").is_file():
            model.load_state_dict(AutoModelForCausalLM.from_pretrained(final).state_dict())
            log.info("%s: loaded finished phase from %s", name, final)
            continue
        t0 = time.time()
        train_phase(
            name,
            model,
            stream,
            eval_chunks,
            args,
            steps,
            batch,
            lr,
            seed=args.seed + (1 if name == "target" else 2),
            teacher=target if teacher else None,
            autocast=ac,
        )
        times[name] = time.time() - t0
        model.save_pretrained(final)
        (final / "train_time_s.txt").write_text(f"{times[name]:.0f}\n")
    for name in ("target", "draft"):
        if name not in times and (work / f"{name}_final" / "train_time_s.txt").is_file():
            times[name] = float((work / f"{name}_final" / "train_time_s.txt").read_text())

    # Export in float16, then evaluate exactly what was exported, loaded in float32.
    gen_cfg = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    for name, model in (("target", target), ("draft", draft)):
        model.generation_config = gen_cfg
        model.to(torch.float16).save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
    target = AutoModelForCausalLM.from_pretrained(out / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(out / "draft", dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "target")

    t_eval = time.time()
    ppl_t, ppl_d = dp.perplexity(target, eval_chunks), dp.perplexity(draft, eval_chunks)
    agree = greedy_agreement(target, draft, eval_chunks)
    prompts = acceptance_prompts(heldout_stream, args.accept_prompts, args.accept_prompt_len, args.seed)
    new = min(args.accept_new_tokens, args.seq_len - args.accept_prompt_len)
    acc = speculative_acceptance(target, draft, prompts, new, args.k)
    samples = {
        p: complete(target, tokenizer, p, args.sample_new_tokens)
        for p in ("def ", "class ", "import ", "    def __init__(self")
    }
    log.info("held-out ppl: target %.3f, draft %.3f; teacher-forced agreement %.4f", ppl_t, ppl_d, agree)
    log.info(
        "greedy SD k=%d: mean accepted length %.3f, token agreement %.4f, histogram %s",
        args.k,
        acc["mean_accepted_len"],
        acc["token_agreement"],
        acc["accepted_hist"],
    )
    for p, s in samples.items():
        log.info("sample %r -> %r", p, s)

    size = sum(f.stat().st_size for d in ("target", "draft") for f in (out / d).rglob("*") if f.is_file())
    heldout_eval = {
        "python_version": platform.python_version(),
        "heldout_percent": args.heldout_percent,
        "max_file_bytes": args.max_file_bytes,
        "n_chunks": args.eval_chunks,
        "seq_len": args.eval_len,
        "slice_sha1": dp.slice_digest(eval_chunks),
        "target_ppl": ppl_t,
        "draft_ppl": ppl_d,
        "target_flops_per_token": ft,
        "draft_flops_per_token": fd,
        "flops_ratio": fd / ft,
    }
    (out / dp.HELDOUT_EVAL_FILE).write_text(json.dumps(heldout_eval, indent=2) + "\n")
    results = dict(
        heldout_eval,
        target_params=n_t,
        draft_params=n_d,
        teacher_forced_agreement=agree,
        acceptance=acc,
        accept_new_tokens=new,
        steps={"target": cap(args.target_steps), "draft": cap(args.draft_steps)},
        samples=samples,
        train_time_s=times,
        eval_time_s=time.time() - t_eval,
        total_time_s=time.time() - t_start,
        train_tokens=stream.numel(),
        train_files=len(train_files),
        heldout_files=len(heldout_files),
        asset_bytes=size,
        command=canonical_command(args),
        args=vars(args),
        vocab_size=len(tokenizer),
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        hardware=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        tokenizers_version=tokenizers.__version__,
    )
    write_model_card(out, results)
    (work / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    log.info("wrote %s (%.1f MB) and %s", out, size / 1e6, work / "results.json")
    return results


if __name__ == "__main__":
    main()
