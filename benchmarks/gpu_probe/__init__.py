"""GPU probe: what a user would run, measured in parts that each finish in under 7 minutes on a cold H200.

    python benchmarks/gpu_probe.py --part A --out DIR      # (or python -m benchmarks.gpu_probe ...)
    python benchmarks/gpu_probe.py --scale tiny --device cpu --out DIR   # every part on tiny models

A  environment (versions, GPU, commit), copy bandwidth, AR at batch 1 with cuda_graphs off and on (and on
   with attention="reduce"), then
   the verify's few-row linears (cuBLAS against Inductor's reductions) and decode attention at a
   2,048-token context (SDPA against flex).
B  SD at batch 1 with cuda_graphs on and off (and c, a draft step's time over a verify's), then AR with graphs on
   when time is left (SD over AR in one run).
C  SSD at batch 1 (its own rounds, and the planner's choice), and how much of the draft lane's build
   hides under the verify.
D  exactness: greedy AR, SD, SSD equal to transformers' generate, then sampled validity, with Inductor
   and CUDA graphs (on CPU: eager).
E  batch 8: AR, SD, SSD.

The speed pair (``--scale 8b``, the default on CUDA) is Llama-3.1-8B's shape at full depth in bfloat16
with random weights made on the GPU, and a 1-layer draft of the same family (about 0.10 of the target's
bytes per token), tuned to ``--acceptance`` greedy agreement. Every speed row records tokens/s, ms per
round, roofline_share, launches_per_stage, host_syncs_per_round (and for SSD hits by position, the
fan-out per round, fallbacks by kind); a torch.profiler trace of a few rounds follows each part's first
timed row, its key_averages() in the JSON. ``OUT/gpu_probe.json`` is rewritten after every row, so a
part cut short keeps what it measured. Inductor's cache is ``.probe_cache/`` in the repository (git-
ignored): a part after the first reuses its compiles on a warm machine. Exit status 1: an exactness
check is false or an exactness sub-phase failed to run.
"""
