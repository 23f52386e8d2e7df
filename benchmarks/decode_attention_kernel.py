"""A hand-written decode attention, measured against the SDPA call the CPU stages make (an experiment: the
library does not use it).

    python benchmarks/decode_attention_kernel.py --threads 1 --json attention_kernel.json
    python benchmarks/decode_attention_kernel.py --threads 1 --programs --passes 3

The kernel (C++, built here by ``torch.utils.cpp_extension.load_inline`` and registered as the op
``saguaro_bench::decode_attention``; the build takes about a minute and needs g++ and ninja): for each KV
head, every folded query row (GQA: the group's heads times the queries) takes the scores of the slots its
additive mask leaves visible (a ``-inf`` slot is skipped, not computed), the softmax with ATen's vectorised
``exp``, then the weighted sum of the V rows, in float32. It takes what ``attention_reference`` takes:
``q [B, H, T, D]``, the store's ``k, v [B, Hkv, S, D]`` and the additive mask ``[B, 1, G*T, S]``.

Rows: one call alone per slot count and query count (``--slots``, 1 and 6 queries), SDPA against the
kernel, interleaved, medians; the largest difference from SDPA. With ``--programs``: the default pair
compiled twice by Inductor in one process, the stages' inline attention being SDPA or this op (the op
swapped in for the attention of layers without softcap or sinks, while the second program's stages are
built; ``--stages steps``: in the one-query stages only, the others keeping SDPA), AR and SD passes alternating, tokens/s after the prefill, and whether every generation equals the
target's greedy ``generate``. Without a build (no compiler, no ninja, not float32-capable) it says why,
writes the reason to ``--json`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

OP = "saguaro_bench::decode_attention"
SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <cmath>
#include <limits>
#include <vector>
using Vec = at::vec::Vectorized<float>;
static inline float dot(const float* a, const float* b, int64_t D) {
  Vec acc(0.f); int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float lanes[Vec::size()]; acc.store(lanes); float s = 0.f;
  for (int i = 0; i < Vec::size(); ++i) s += lanes[i];
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}
static inline void axpy(float w, const float* x, float* y, int64_t D) {
  const Vec wv(w); int64_t d = 0;
  for (; d + Vec::size() <= D; d += Vec::size()) at::vec::fmadd(wv, Vec::loadu(x + d), Vec::loadu(y + d)).store(y + d);
  for (; d < D; ++d) y[d] += w * x[d];
}
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bias,
                            double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat &&
              bias.scalar_type() == at::kFloat, "decode_attention: float32 only");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: K and V need a unit last stride");
  auto qc = q.contiguous();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  const int64_t G = H / Hkv;
  auto out = at::empty({B, H, T, D}, q.options());
  const float *qp = qc.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float ninf = -std::numeric_limits<float>::infinity(), sc = static_cast<float>(scale);
  const int64_t R = G * T;  // folded query rows of one KV head: head h*G + r/T, query r%T
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(R * S), acc(R * D), mx(R), sum(R);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / Hkv, h = idx % Hkv;
      const float* kb = kp + b * k.stride(0) + h * k.stride(1);
      const float* vb = vp + b * v.stride(0) + h * v.stride(1);
      const float* qb = qp + (b * H + h * G) * T * D;  // the R rows are adjacent in q [B, H, T, D]
      const float* bb = bp + b * bias.stride(0);
      std::fill(mx.begin(), mx.end(), ninf);
      for (int64_t s = 0; s < S; ++s) {  // each K row read once for all R rows
        const float* ks = kb + s * k.stride(2);
        for (int64_t r = 0; r < R; ++r) {
          const float m = bb[r * bias.stride(2) + s * bias.stride(3)];
          const float l = m == ninf ? ninf : dot(qb + r * D, ks, D) * sc + m;
          p[r * S + s] = l; mx[r] = l > mx[r] ? l : mx[r];
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        float* pr = p.data() + r * S;
        Vec sums(0.f); int64_t s = 0;
        for (; s + Vec::size() <= S; s += Vec::size()) {
          Vec e = (Vec::loadu(pr + s) - Vec(mx[r])).exp(); e.store(pr + s); sums = sums + e;
        }
        float lanes[Vec::size()]; sums.store(lanes); float total = 0.f;
        for (int i = 0; i < Vec::size(); ++i) total += lanes[i];
        for (; s < S; ++s) { pr[s] = std::exp(pr[s] - mx[r]); total += pr[s]; }
        sum[r] = total;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = 0; s < S; ++s) {  // each V row read once for all R rows
        const float* vs = vb + s * v.stride(2);
        for (int64_t r = 0; r < R; ++r) {
          const float w = p[r * S + s];
          if (w != 0.f) axpy(w, vs, acc.data() + r * D, D);
        }
      }
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < D; ++d) op[(b * H + h * G) * T * D + r * D + d] = acc[r * D + d] / sum[r];
    }
  });
  return out;
}
TORCH_LIBRARY(saguaro_bench, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor bias, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(saguaro_bench, CPU, m) { m.impl("decode_attention", &decode_attention); }
"""


def capability_flags(capability: str) -> list:
    """The defines that make ATen's ``Vectorized`` use this CPU's vector width (torch's own choice)."""
    if capability in ("AVX512", "AVX2"):
        return [f"-DCPU_CAPABILITY_{capability}", f"-DCPU_CAPABILITY={capability}", "-march=native"]
    return []


def build(directory: str | None = None) -> None:
    """Build and register the op (``OP``) and its fake kernel; raises when it cannot be built here."""
    from torch.utils.cpp_extension import load_inline, verify_ninja_availability

    verify_ninja_availability()
    flags = ["-O3", *capability_flags(torch.backends.cpu.get_cpu_capability())]
    load_inline("saguaro_bench_decode_attention", cpp_sources=SOURCE, extra_cflags=flags, is_python_module=False,
                build_directory=directory, verbose=False)

    @torch.library.register_fake(OP)
    def _fake(q, k, v, bias, scale):
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def micro_rows(slots: list, repeats: int) -> list:
    """One call alone, SDPA against the op, interleaved; medians in microseconds."""
    op = torch.ops.saguaro_bench.decode_attention
    rows = []
    for S in slots:
        for T in (1, 6):
            q, k, v = torch.randn(1, 6, T, 64), torch.randn(1, 6, S, 64), torch.randn(1, 6, S, 64)
            bias = torch.zeros(1, 1, T, S)
            bias[..., (S * 3) // 5:] = float("-inf")  # a store 60 % full
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=0.125)
            kernel = lambda: op(q, k, v, bias, 0.125)
            error = (kernel() - sdpa()).abs().max().item()
            times = {"sdpa": [], "kernel": []}
            with torch.inference_mode():
                for _ in range(repeats):
                    for name, fn in (("sdpa", sdpa), ("kernel", kernel)):
                        started = time.perf_counter()
                        for _ in range(200):
                            fn()
                        times[name].append((time.perf_counter() - started) / 200 * 1e6)
            rows.append({"slots": S, "queries": T, "sdpa_us": statistics.median(times["sdpa"]),
                         "kernel_us": statistics.median(times["kernel"]), "max_abs_difference": error})
    return rows


def program_rows(passes: int, new: int, stages: str = "all") -> dict:
    """The default pair twice (stages' attention SDPA, then the op: in every stage, or with ``stages="steps"``
    in the one-query stages only), AR and SD passes alternating."""
    import saguaro
    import saguaro.passes.lower_attention as lowering
    from saguaro.bench.passes import TimedPass
    from saguaro.bench.prompts import bench_prompts

    inline = lowering.attention_inline

    def with_kernel(query, key, value, k_cache, v_cache, write_slots, bias, scale, softcap=0.0, sinks=None):
        if softcap != 0.0 or sinks is not None or (stages == "steps" and query.shape[2] != 1):
            return inline(query, key, value, k_cache, v_cache, write_slots, bias, scale, softcap, sinks)
        lowering.write_kv(key, value, k_cache, v_cache, write_slots)
        return torch.ops.saguaro_bench.decode_attention(query, k_cache, v_cache, bias, scale)

    target, draft, tokenizer = saguaro.default_pair()
    prompts = bench_prompts(tokenizer, 4, target.config.vocab_size, 0, default_pair=True,
                            max_tokens=target.config.max_position_embeddings - new)
    with torch.no_grad():
        expected = [target.generate(ids, max_new_tokens=new, do_sample=False) for ids in prompts]
    programs = {}
    for name, attention in (("sdpa", inline), ("kernel", with_kernel)):
        lowering.attention_inline = attention  # read by the pass while this program's stages are built
        try:
            program = saguaro.compile(target, draft, k=5, mode="sd", backend="inductor", compile="blocking")
            for mode in ("ar", "sd"):
                for ids in prompts:
                    program.generate(ids, max_new_tokens=new, mode=mode)
        finally:
            lowering.attention_inline = inline
        programs[name] = program
    rates = {(name, mode): [] for name in programs for mode in ("ar", "sd")}
    exact = True
    for rep in range(passes):
        for mode in ("ar", "sd"):
            for name in (list(programs) if rep % 2 == 0 else list(reversed(list(programs)))):
                timed = TimedPass()
                for ids, want in zip(prompts, expected):
                    started = time.perf_counter()
                    out = programs[name].generate(ids, max_new_tokens=new, mode=mode)
                    timed.add(out.stats["new_tokens"], time.perf_counter() - started, out)
                    exact &= torch.equal(out.sequences[:, :want.shape[1]], want)
                rates[(name, mode)].append(timed.decode_tokens_per_s)
    for program in programs.values():
        program.close()
    return {"exact": exact, "rows": [{"mode": mode, "sdpa": statistics.median(rates[("sdpa", mode)]),
                                      "kernel": statistics.median(rates[("kernel", mode)])} for mode in ("ar", "sd")]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--slots", default="128,256,1024", help="comma-separated KV slot counts (default 128,256,1024)")
    p.add_argument("--repeats", type=int, default=9, help="interleaved timings per call (default 9)")
    p.add_argument("--programs", action="store_true", help="also time the default pair's AR and SD with the op")
    p.add_argument("--stages", choices=["all", "steps"], default="all",
                   help="with --programs: the op in every stage, or in the one-query stages only (default all)")
    p.add_argument("--passes", type=int, default=3, help="passes per program and mode with --programs (default 3)")
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt with --programs (default 128)")
    p.add_argument("--build-dir", help="where the extension is built (default: torch's extensions folder)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    slots = [int(s) for s in args.slots.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        build(args.build_dir)
    except Exception as exc:  # no compiler, no ninja, a failed build: the experiment cannot run here
        why = f"the kernel could not be built here ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})"
        print(f"decode_attention_kernel.py: skipped: {why}")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": why}, indent=2))
        return 0
    report = {"threads": torch.get_num_threads(), "calls": micro_rows(slots, args.repeats)}
    print(f"threads {report['threads']}; one call, 6 heads x 64, a store 60 % full; medians (us)")
    print(f"{'slots':>6}{'queries':>9}{'sdpa':>9}{'kernel':>9}{'ratio':>7}{'max |diff|':>12}")
    for r in report["calls"]:
        print(f"{r['slots']:>6}{r['queries']:>9}{r['sdpa_us']:>9.1f}{r['kernel_us']:>9.1f}"
              f"{r['sdpa_us'] / r['kernel_us']:>7.2f}{r['max_abs_difference']:>12.1e}")
    if args.programs:
        report["programs"] = program_rows(args.passes, args.new, args.stages)
        for r in report["programs"]["rows"]:
            print(f"{r['mode']}: sdpa {r['sdpa']:.1f}, kernel {r['kernel']:.1f} tokens/s after the prefill "
                  f"({r['kernel'] / r['sdpa']:.3f}x)")
        print("every generation equals the target's greedy generate:", report["programs"]["exact"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report.get("programs", {}).get("exact", True) else 1


if __name__ == "__main__":
    sys.exit(main())
