// saguaro_kernels::packed_linear(x [M, K] float32, packed [P, K, 64] float32 | float16 | bfloat16, n) -> [M, n]
// saguaro_kernels::packed_linear_q(x [M, K] float32, packed [P, K, 64] int8 | [P, K/2, 64] uint8 (int4),
//                                  scales [P, G, 64] float32, n) -> [M, n]
//
// A linear layer of few rows against a weight packed in panels of 64 output columns (packed_linear.py packs it
// once per weight; packed_weights.h says how each stored kind widens). Each output is one float32 accumulator
// summed over k = 0 .. K-1 in order with fused multiply-adds (rounded once each), whatever the weight's storage
// dtype, the vector width, the number of rows or the thread count: a weight held in float16 or bfloat16 is
// widened in registers to the very float32 values, so the result equals the float32 weight's bit for bit, and a
// quantized weight is widened to float(q) * scale (rounded once) before its multiply-add, so the result equals
// its dequantized float32 weight's. A row of a panel is 64 contiguous weights, so a panel streams from memory
// as one sequential run: each thread reads its panels front to back, which is what the hardware prefetchers
// follow best (the memory roofline is the point: a few-row linear's time is its weights' bytes).
// With AVX-512 a block is up to 6 rows x 64 columns in 24 registers, each panel row loaded and widened once for
// all the block's rows; with AVX2 (+ FMA, F16C) up to 6 rows x 16 columns in 12 registers, a panel's four
// 16-column slices one after another; any other machine
// runs the scalar loop, which computes the same fused multiply-adds in the same order.
// Written against torch's stable ABI (torch/csrc/stable): its headers compile in seconds, where ATen's
// take most of a minute, and the library keeps working across torch versions.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "packed_weights.h"
#include "stable_tensors.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace {

using saguaro::Brain, saguaro::Half, saguaro::Nibbles, saguaro::NB, saguaro::NV;
using saguaro::row_offset, saguaro::stored_rows, saguaro::weight_at;

constexpr int MR = 6;                   // rows per register block
constexpr int64_t PREFETCH_BYTES = 1024;  // how far ahead of its loads a block prefetches the panel's stream
constexpr int64_t WORKER_SLOTS = 256;     // parallel_for's range: more than any thread count, each slot a taker

// One panel's weights and, when quantized, its scales [G, 64] (group: the k rows one scale row covers).
template <typename W>
struct Panel {
  const W* w;
  const float* scales;  // nullptr: not quantized
  int64_t group;        // K when not quantized
};

template <typename W>
void panel_scalar(const float* x, int64_t K, Panel<W> p, int64_t rows, float* out, int64_t ldo, int64_t cols) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) {
        float w = weight_at(p.w, k, c);
        if (p.scales) w = w * p.scales[(k / p.group) * NB + c];
        acc = std::fma(x[m * K + k], w, acc);
      }
      out[m * ldo + c] = acc;
    }
  }
}

#ifdef SAGUARO_AVX512
// One k step of a block: acc[r][j] = fma(x[r, k], v[j], acc[r][j]) for its R rows and 4 vectors.
template <int R>
__attribute__((always_inline)) inline void multiply_add(__m512 (&acc)[R][NV], const float* x, int64_t K, int64_t k,
                                                        const __m512 (&v)[NV]) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 b = _mm512_set1_ps(x[r * K + k]);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_fmadd_ps(b, v[j], acc[r][j]);
  }
}

// R rows x 64 columns: acc[r][j] = fma(x[r, k], w[k, 16j .. 16j+15], acc[r][j]), k in order.
template <typename W, bool QUANT, int R>
void block(const float* x, int64_t K, Panel<W> p, float* out, int64_t ldo, int64_t cols) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(p.w) + PREFETCH_BYTES;
  for (int64_t k0 = 0; k0 < K; k0 += p.group) {
    const int64_t k1 = std::min(K, k0 + p.group);
    __m512 s[NV];
    if constexpr (QUANT) {
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) s[j] = _mm512_loadu_ps(p.scales + (k0 / p.group) * NB + 16 * j);
    }
    if constexpr (std::is_same_v<W, Nibbles>) {
      // two k rows a byte row: each 16 bytes widened once, the low nibbles (k even) and the high ones (k odd)
      // looked up in a table of the 16 values q = -8 .. 7 (vpermps reads an index's low 4 bits only)
      const __m512 table = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f,
                                          5.f, 6.f, 7.f);
      for (int64_t k = k0; k < k1; k += 2) {
        const Nibbles* row = p.w + row_offset<W>(k);
        _mm_prefetch(ahead + row_offset<W>(k), _MM_HINT_T0);
        __m512 even[NV], odd[NV];
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) {
          const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j)));
          even[j] = _mm512_mul_ps(_mm512_permutexvar_ps(bytes, table), s[j]);
          odd[j] = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table), s[j]);
        }
        multiply_add<R>(acc, x, K, k, even);
        multiply_add<R>(acc, x, K, k + 1, odd);
      }
    } else {
    for (int64_t k = k0; k < k1; ++k) {
      __m512 v[NV];
      const W* row = p.w + row_offset<W>(k);
      const char* next = ahead + row_offset<W>(k) * sizeof(W);
      _mm_prefetch(next, _MM_HINT_T0);
      if constexpr (NB * sizeof(W) > 64) _mm_prefetch(next + 64, _MM_HINT_T0);
      if constexpr (NB * sizeof(W) > 128) {
        _mm_prefetch(next + 128, _MM_HINT_T0);
        _mm_prefetch(next + 192, _MM_HINT_T0);
      }
      saguaro::load64(row, v);
      if constexpr (QUANT) {
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) v[j] = _mm512_mul_ps(v[j], s[j]);
      }
      multiply_add<R>(acc, x, K, k, v);
    }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const int64_t left = cols - 16 * j;
      if (left <= 0) break;
      const __mmask16 mask = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      _mm512_mask_storeu_ps(out + r * ldo + 16 * j, mask, acc[r][j]);
    }
}
#elif defined(SAGUARO_AVX2)
// R rows x the j-th 16 columns of a panel in 2R registers.
template <typename W, bool QUANT, int R>
void block16(const float* x, int64_t K, Panel<W> p, int j, float* out, int64_t ldo, int64_t cols) {
  __m256 lo_acc[R], hi_acc[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo_acc[r] = hi_acc[r] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += p.group) {
    const int64_t k1 = std::min(K, k0 + p.group);
    __m256 s_lo, s_hi;
    if constexpr (QUANT) {
      s_lo = _mm256_loadu_ps(p.scales + (k0 / p.group) * NB + 16 * j);
      s_hi = _mm256_loadu_ps(p.scales + (k0 / p.group) * NB + 16 * j + 8);
    }
    for (int64_t k = k0; k < k1; ++k) {
      __m256 lo, hi;
      const W* row = p.w + row_offset<W>(k);
      if constexpr (std::is_same_v<W, Nibbles>) saguaro::load16(row, j, (k & 1) != 0, lo, hi);
      else saguaro::load16(row, j, lo, hi);
      if constexpr (QUANT) {
        lo = _mm256_mul_ps(lo, s_lo);
        hi = _mm256_mul_ps(hi, s_hi);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 b = _mm256_broadcast_ss(x + r * K + k);
        lo_acc[r] = _mm256_fmadd_ps(b, lo, lo_acc[r]);
        hi_acc[r] = _mm256_fmadd_ps(b, hi, hi_acc[r]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) saguaro::store16(out + r * ldo + 16 * j, lo_acc[r], hi_acc[r], cols - 16 * j);
}
template <typename W, bool QUANT, int R>
void block(const float* x, int64_t K, Panel<W> p, float* out, int64_t ldo, int64_t cols) {
  for (int j = 0; j < NV && 16 * j < cols; ++j) block16<W, QUANT, R>(x, K, p, j, out, ldo, cols);
}
#endif

#ifdef SAGUARO_AVX2
// Every row of x against one panel, MR rows at a time.
template <typename W, bool QUANT>
void panel_vector(const float* x, int64_t M, int64_t K, Panel<W> p, float* out, int64_t ldo, int64_t cols) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) block<W, QUANT, MR>(x + m * K, K, p, out + m * ldo, ldo, cols);
  const float* xm = x + m * K;
  float* om = out + m * ldo;
  switch (M - m) {
    case 5: block<W, QUANT, 5>(xm, K, p, om, ldo, cols); break;
    case 4: block<W, QUANT, 4>(xm, K, p, om, ldo, cols); break;
    case 3: block<W, QUANT, 3>(xm, K, p, om, ldo, cols); break;
    case 2: block<W, QUANT, 2>(xm, K, p, om, ldo, cols); break;
    case 1: block<W, QUANT, 1>(xm, K, p, om, ldo, cols); break;
    default: break;
  }
}
#endif

template <typename W>
void run(const float* x, int64_t M, int64_t K, const W* w, const float* scales, int64_t groups, int64_t panels,
         float* out, int64_t n, bool vector) {
  const int64_t panel_elements = stored_rows<W>(K) * NB, group = scales ? K / groups : K;
  auto panel_range = [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      Panel<W> p{w + q * panel_elements, scales ? scales + q * groups * NB : nullptr, group};
      const int64_t cols = std::min<int64_t>(NB, n - q * NB);
#ifdef SAGUARO_AVX2
      if (vector) {
        if (scales) panel_vector<W, true>(x, M, K, p, out + q * NB, n, cols);
        else panel_vector<W, false>(x, M, K, p, out + q * NB, n, cols);
        continue;
      }
#endif
      panel_scalar(x, M == 0 ? 0 : K, p, M, out + q * NB, n, cols);
    }
  };
  // grain: about 256K multiply-adds a chunk of panels, so the draft's small linears stay on one thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, M * K * NB));
  if (panels <= grain) {
    panel_range(0, panels);
    return;
  }
  // Dynamic shares: the threads take chunks of panels in turn from one counter, so a thread slowed by another
  // tenant of its core takes fewer, where a static split would wait for it (on a shared machine a one-row step
  // ran at a third of its rate so). Each chunk is a sequential run of at least `grain` panels.
  const int64_t chunk = std::max<int64_t>(grain, panels / 32);
  std::atomic<int64_t> next{0};
  torch::stable::parallel_for(0, WORKER_SLOTS, 1, [&](int64_t, int64_t) {
    for (int64_t begin = next.fetch_add(chunk); begin < panels; begin = next.fetch_add(chunk))
      panel_range(begin, std::min(panels, begin + chunk));
  });
}

void check(bool ok, const char* message) {
  if (!ok) throw std::runtime_error(message);
}

using torch::headeronly::ScalarType;

torch::stable::Tensor start(const torch::stable::Tensor& x_in, const torch::stable::Tensor& packed, int64_t n,
                            torch::stable::Tensor& x) {
  check(x_in.dim() == 2 && x_in.scalar_type() == ScalarType::Float, "packed_linear: x must be [M, K] float32");
  check(packed.dim() == 3 && packed.size(2) == NB && packed.is_contiguous(),
        "packed_linear: packed must be a contiguous [P, K, 64] panel tensor");
  check(n > (packed.size(0) - 1) * NB && n <= packed.size(0) * NB, "packed_linear: n does not fit the panels");
  x = saguaro::contiguous_of(x_in);
  return saguaro::new_float(x, {x.size(0), n});
}

torch::stable::Tensor packed_linear_impl(const torch::stable::Tensor& x_in, const torch::stable::Tensor& packed,
                                         int64_t n, bool vector) {
  torch::stable::Tensor x = x_in;
  torch::stable::Tensor out = start(x_in, packed, n, x);
  check(packed.size(1) == x.size(1), "packed_linear: packed must be a [P, K, 64] panel tensor of x's K");
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  if (M == 0) return out;
  const float* xp = static_cast<const float*>(x.const_data_ptr());
  float* op = static_cast<float*>(out.mutable_data_ptr());
  const void* wp = packed.const_data_ptr();
  switch (packed.scalar_type()) {
    case ScalarType::Float: run(xp, M, K, static_cast<const float*>(wp), nullptr, 1, panels, op, n, vector); break;
    case ScalarType::Half: run(xp, M, K, static_cast<const Half*>(wp), nullptr, 1, panels, op, n, vector); break;
    case ScalarType::BFloat16: run(xp, M, K, static_cast<const Brain*>(wp), nullptr, 1, panels, op, n, vector); break;
    default: check(false, "packed_linear: packed must be float32, float16 or bfloat16");
  }
  return out;
}

torch::stable::Tensor packed_linear_q_impl(const torch::stable::Tensor& x_in, const torch::stable::Tensor& packed,
                                           const torch::stable::Tensor& scales, int64_t n, bool vector) {
  torch::stable::Tensor x = x_in;
  torch::stable::Tensor out = start(x_in, packed, n, x);
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  const bool int4 = packed.scalar_type() == ScalarType::Byte;
  check(int4 || packed.scalar_type() == ScalarType::Char, "packed_linear_q: packed must be int8, or uint8 for int4");
  check(packed.size(1) == (int4 ? (K + 1) / 2 : K), "packed_linear_q: packed's rows do not fit x's K");
  check(scales.dim() == 3 && scales.scalar_type() == ScalarType::Float && scales.is_contiguous() &&
            scales.size(0) == panels && scales.size(2) == NB && scales.size(1) > 0 && K % scales.size(1) == 0,
        "packed_linear_q: scales must be a contiguous float32 [P, G, 64] tensor, G dividing K");
  const int64_t groups = scales.size(1);
  check(!int4 || (K / groups) % 2 == 0, "packed_linear_q: int4 groups must hold an even number of k");
  if (M == 0) return out;
  const float* xp = static_cast<const float*>(x.const_data_ptr());
  float* op = static_cast<float*>(out.mutable_data_ptr());
  const float* sp = static_cast<const float*>(scales.const_data_ptr());
  const void* wp = packed.const_data_ptr();
  if (int4) run(xp, M, K, static_cast<const Nibbles*>(wp), sp, groups, panels, op, n, vector);
  else run(xp, M, K, static_cast<const int8_t*>(wp), sp, groups, panels, op, n, vector);
  return out;
}

torch::stable::Tensor packed_linear(torch::stable::Tensor x, torch::stable::Tensor packed, int64_t n) {
  return packed_linear_impl(x, packed, n, true);
}
torch::stable::Tensor packed_linear_scalar(torch::stable::Tensor x, torch::stable::Tensor packed, int64_t n) {
  return packed_linear_impl(x, packed, n, false);
}
torch::stable::Tensor packed_linear_q(torch::stable::Tensor x, torch::stable::Tensor packed,
                                      torch::stable::Tensor scales, int64_t n) {
  return packed_linear_q_impl(x, packed, scales, n, true);
}
torch::stable::Tensor packed_linear_q_scalar(torch::stable::Tensor x, torch::stable::Tensor packed,
                                             torch::stable::Tensor scales, int64_t n) {
  return packed_linear_q_impl(x, packed, scales, n, false);
}

// The bytes of `buffer` read once, front to back, split across the threads as the linears split their panels, each
// 64-byte line folded into a running XOR (so nothing can be skipped); returns that fold as a number. What a
// stream of weights can reach on this machine: packed_linear.py's read_bandwidth times it.
double stream_read(torch::stable::Tensor buffer) {
  check(buffer.is_contiguous(), "stream_read: buffer must be contiguous");
  const char* base = static_cast<const char*>(buffer.const_data_ptr());
  const int64_t lines = buffer.numel() * buffer.element_size() / 64;
  constexpr int64_t CHUNK = 4096;  // lines a task: 256 KiB
  const int64_t chunks = (lines + CHUNK - 1) / CHUNK;
  std::vector<uint64_t> folds(chunks, 0);
  torch::stable::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t first = c * CHUNK, last = std::min(lines, first + CHUNK);
#ifdef SAGUARO_AVX512
      __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0;
      int64_t l = first;
      for (; l + 2 <= last; l += 2) {
        acc0 = _mm512_xor_si512(acc0, _mm512_loadu_si512(base + l * 64));
        acc1 = _mm512_xor_si512(acc1, _mm512_loadu_si512(base + l * 64 + 64));
      }
      if (l < last) acc0 = _mm512_xor_si512(acc0, _mm512_loadu_si512(base + l * 64));
      alignas(64) uint64_t lanes[8];
      _mm512_store_si512(lanes, _mm512_xor_si512(acc0, acc1));
      uint64_t fold = 0;
      for (uint64_t lane : lanes) fold ^= lane;
#else
      uint64_t fold = 0;
      for (int64_t l = first; l < last; ++l) {
        uint64_t word[8];
        std::memcpy(word, base + l * 64, 64);
        for (uint64_t w : word) fold ^= w;
      }
#endif
      folds[c] = fold;
    }
  });
  uint64_t all = 0;
  for (uint64_t f : folds) all ^= f;
  return double(all & 0xffff);
}

bool vectorised() {
#ifdef SAGUARO_AVX2
  return true;
#else
  return false;
#endif
}

}  // namespace

STABLE_TORCH_LIBRARY(saguaro_kernels, m) {
  m.def("packed_linear(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("packed_linear_scalar(Tensor x, Tensor packed, int n) -> Tensor");
  m.def("packed_linear_q(Tensor x, Tensor packed, Tensor scales, int n) -> Tensor");
  m.def("packed_linear_q_scalar(Tensor x, Tensor packed, Tensor scales, int n) -> Tensor");
  m.def("vectorised() -> bool");
  m.def("stream_read(Tensor buffer) -> float");
}

STABLE_TORCH_LIBRARY_IMPL(saguaro_kernels, CPU, m) {
  m.impl("packed_linear", TORCH_BOX(&packed_linear));
  m.impl("packed_linear_scalar", TORCH_BOX(&packed_linear_scalar));
  m.impl("packed_linear_q", TORCH_BOX(&packed_linear_q));
  m.impl("packed_linear_q_scalar", TORCH_BOX(&packed_linear_q_scalar));
  m.impl("stream_read", TORCH_BOX(&stream_read));
}

STABLE_TORCH_LIBRARY_IMPL(saguaro_kernels, CompositeExplicitAutograd, m) { m.impl("vectorised", TORCH_BOX(&vectorised)); }
