"""Saguaro's Python API end to end: the default pair, compiled for speculative decoding."""

import torch

import saguaro

target, draft, tokenizer = saguaro.default_pair()  # small Llama target + draft, one tokenizer
program = saguaro.compile(target, draft, k=5, mode="sd", backend="eager")

prompt = "def fibonacci(n):"
input_ids = tokenizer(prompt, return_tensors="pt").input_ids  # [1, T]
out = program.generate(input_ids, max_new_tokens=64, temperature=0.0)

print(prompt + tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True))
s = out.stats
print(
    f"{s['new_tokens']} tokens in {s['wall_s']:.2f}s ({s['tokens_per_s']:.1f} tokens/s), "
    f"mean accepted length {s['mean_accepted_len']:.2f} over {s['rounds']} rounds"
)

# Lossless: greedy SD returns exactly the target's own greedy output (mode="ar" runs the target alone).
reference = program.generate(input_ids, max_new_tokens=64, temperature=0.0, mode="ar")
assert torch.equal(out.sequences, reference.sequences)
