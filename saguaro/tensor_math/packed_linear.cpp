// saguaro_kernels::packed_linear(x [M, K] float32, packed [P, K, 16] float32 | float16 | bfloat16, n) -> [M, n]
//
// A linear layer of few rows against a weight packed in panels of 16 output columns (packed_linear.py packs
// it once per weight). Each output is one float32 accumulator summed over k = 0 .. K-1 in order with fused
// multiply-adds (std::fma: rounded once), whatever the weight's storage dtype, the vector width or the thread
// count: a weight held in float16 or bfloat16 is widened in registers to the very float32 values, so the
// result equals the float32 weight's bit for bit. The vector path (AVX2 + FMA + F16C) holds a block of up to
// 6 rows x 16 columns in 12 registers and reads each weight panel once per block of rows; one or two rows (AR's
// round, the draft's steps) run several panels side by side instead, in AVX-512 registers where the machine has them;
// any other machine runs the scalar loop, which computes the same fused multiply-adds in the same order.
// Written against torch's stable ABI (torch/csrc/stable): its headers compile in seconds, where ATen's
// take most of a minute, and the library keeps working across torch versions.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include "packed_weights.h"
#include "stable_tensors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>

namespace {

using saguaro::Brain, saguaro::Half, saguaro::NB, saguaro::widen;
#ifdef SAGUARO_AVX2
using saguaro::load16, saguaro::store16;
#endif

constexpr int64_t MR = 6;   // rows per register block
constexpr int64_t PREFETCH_BYTES = 2048;  // how far ahead of the loads the weight stream is prefetched
constexpr int64_t ROW_PREFETCH_BYTES = 512;  // the same for each panel a one-row block streams
constexpr int64_t SMALL_ROWS = 2;  // up to this many rows run as one-row blocks, the multi-row blocks beyond

template <typename W>
void panel_scalar(const float* x, int64_t K, const W* w, int64_t rows, float* out, int64_t ldo, int64_t cols) {
  for (int64_t m = 0; m < rows; ++m) {
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(x[m * K + k], widen(w[k * NB + c]), acc);
      out[m * ldo + c] = acc;
    }
  }
}

#ifdef SAGUARO_AVX2
// One row's two accumulators over 16 columns: acc = fma(x[r, k], w[k, :], acc), k in order.
#define SAGUARO_ROW(r)                                          \
  if constexpr (R > r) {                                        \
    __m256 b = _mm256_broadcast_ss(x + r * K + k);              \
    c##r##0 = _mm256_fmadd_ps(b, lo, c##r##0);                  \
    c##r##1 = _mm256_fmadd_ps(b, hi, c##r##1);                  \
  }

// R rows x 16 columns in 2R named registers. Named, not an array: GCC kept an accumulator array in memory
// and stored all 12 registers to the stack at every k (12 stores a step, about half the block's time).
template <typename W, int R>
void block(const float* x, int64_t K, const W* w, float* out, int64_t ldo, int64_t cols) {
  const __m256 zero = _mm256_setzero_ps();
  __m256 c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero;
  __m256 c30 = zero, c31 = zero, c40 = zero, c41 = zero, c50 = zero, c51 = zero;
  const char* ahead = reinterpret_cast<const char*>(w) + PREFETCH_BYTES;
  for (int64_t k = 0; k < K; ++k) {
    __m256 lo, hi;
    _mm_prefetch(ahead + k * NB * sizeof(W), _MM_HINT_T0);
    load16(w + k * NB, lo, hi);
    SAGUARO_ROW(0) SAGUARO_ROW(1) SAGUARO_ROW(2) SAGUARO_ROW(3) SAGUARO_ROW(4) SAGUARO_ROW(5)
  }
  store16(out, c00, c01, cols);
  if constexpr (R > 1) store16(out + ldo, c10, c11, cols);
  if constexpr (R > 2) store16(out + 2 * ldo, c20, c21, cols);
  if constexpr (R > 3) store16(out + 3 * ldo, c30, c31, cols);
  if constexpr (R > 4) store16(out + 4 * ldo, c40, c41, cols);
  if constexpr (R > 5) store16(out + 5 * ldo, c50, c51, cols);
}
#undef SAGUARO_ROW

// One or two rows (R) against Q panels side by side: R x Q independent accumulator sets, so the multiply-adds
// overlap (a single panel's accumulators would wait out the FMA latency at every k), and each panel's weights
// are loaded once for both rows. Each output is still one float32 sum over k = 0 .. K-1 in order, the
// multi-row blocks' operations exactly. With AVX-512 a panel's 16 columns are one register (one load and one
// widening a step; 6 panels, 12 accumulators at two rows); with AVX2 two (4 panels of one row or 2 of two: 8
// accumulators, with the broadcasts and the loads, within the 16 registers).
#if defined(__AVX512F__)
constexpr int panels_per_block(int rows) { return rows > 0 ? 6 : 0; }
inline __m512 load16z(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16z(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m512 load16z(const Brain* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#define SAGUARO_PANEL(q)                                                \
  if constexpr (Q > q) {                                                \
    _mm_prefetch(ahead + (q * K + k) * NB * sizeof(W), _MM_HINT_T0);    \
    __m512 v = load16z(w + q * K * NB + k * NB);                        \
    c##q = _mm512_fmadd_ps(b, v, c##q);                                 \
    if constexpr (R > 1) d##q = _mm512_fmadd_ps(e, v, d##q);            \
  }
#define SAGUARO_STORE(q)                                                                             \
  if constexpr (Q > q) {                                                                             \
    int64_t cols = std::min<int64_t>(NB, n_left - q * NB);                                           \
    __mmask16 mask = cols >= NB ? __mmask16(0xffff) : __mmask16((1u << cols) - 1);                   \
    _mm512_mask_storeu_ps(out + q * NB, mask, c##q);                                                 \
    if constexpr (R > 1) _mm512_mask_storeu_ps(out + ldo + q * NB, mask, d##q);                      \
  }
template <typename W, int R, int Q>
void row_block(const float* x, int64_t K, const W* w, float* out, int64_t ldo, int64_t n_left) {
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0;
  __m512 d0 = c0, d1 = c0, d2 = c0, d3 = c0, d4 = c0, d5 = c0;
  const char* ahead = reinterpret_cast<const char*>(w) + ROW_PREFETCH_BYTES;
  for (int64_t k = 0; k < K; ++k) {
    __m512 b = _mm512_set1_ps(x[k]), e = R > 1 ? _mm512_set1_ps(x[K + k]) : b;
    SAGUARO_PANEL(0) SAGUARO_PANEL(1) SAGUARO_PANEL(2) SAGUARO_PANEL(3) SAGUARO_PANEL(4) SAGUARO_PANEL(5)
  }
  SAGUARO_STORE(0) SAGUARO_STORE(1) SAGUARO_STORE(2) SAGUARO_STORE(3) SAGUARO_STORE(4) SAGUARO_STORE(5)
}
#else
constexpr int panels_per_block(int rows) { return rows > 1 ? 2 : 4; }
#define SAGUARO_PANEL(q)                                              \
  if constexpr (Q > q) {                                              \
    __m256 lo, hi;                                                    \
    _mm_prefetch(ahead + (q * K + k) * NB * sizeof(W), _MM_HINT_T0);  \
    load16(w + q * K * NB + k * NB, lo, hi);                          \
    c##q##0 = _mm256_fmadd_ps(b, lo, c##q##0);                        \
    c##q##1 = _mm256_fmadd_ps(b, hi, c##q##1);                        \
    if constexpr (R > 1) {                                            \
      d##q##0 = _mm256_fmadd_ps(e, lo, d##q##0);                      \
      d##q##1 = _mm256_fmadd_ps(e, hi, d##q##1);                      \
    }                                                                 \
  }
#define SAGUARO_STORE(q)                                                                         \
  if constexpr (Q > q) {                                                                         \
    store16(out + q * NB, c##q##0, c##q##1, std::min<int64_t>(NB, n_left - q * NB));             \
    if constexpr (R > 1) store16(out + ldo + q * NB, d##q##0, d##q##1, std::min<int64_t>(NB, n_left - q * NB)); \
  }
template <typename W, int R, int Q>
void row_block(const float* x, int64_t K, const W* w, float* out, int64_t ldo, int64_t n_left) {
  static_assert(R * Q <= 4, "AVX2: at most 8 accumulators");
  const __m256 zero = _mm256_setzero_ps();
  __m256 c00 = zero, c01 = zero, c10 = zero, c11 = zero, c20 = zero, c21 = zero, c30 = zero, c31 = zero;
  __m256 d00 = zero, d01 = zero, d10 = zero, d11 = zero, d20 = zero, d21 = zero, d30 = zero, d31 = zero;  // R * Q <= 4
  const char* ahead = reinterpret_cast<const char*>(w) + ROW_PREFETCH_BYTES;
  for (int64_t k = 0; k < K; ++k) {
    __m256 b = _mm256_broadcast_ss(x + k), e = R > 1 ? _mm256_broadcast_ss(x + K + k) : b;
    SAGUARO_PANEL(0) SAGUARO_PANEL(1) SAGUARO_PANEL(2) SAGUARO_PANEL(3)
  }
  SAGUARO_STORE(0) SAGUARO_STORE(1) SAGUARO_STORE(2) SAGUARO_STORE(3)
}
#endif
#undef SAGUARO_PANEL
#undef SAGUARO_STORE

// R rows against panels p0 .. p1-1, panels_per_block(R) at a time (the last group may be narrower).
template <typename W, int R>
void row_blocks(const float* x, int64_t K, const W* w, int64_t p0, int64_t p1, float* out, int64_t n) {
  constexpr int QR = panels_per_block(R);
  int64_t p = p0;
  for (; p + QR <= p1; p += QR) row_block<W, R, QR>(x, K, w + p * K * NB, out + p * NB, n, n - p * NB);
  const int64_t left = p1 - p;
  if constexpr (QR > 5) if (left == 5) row_block<W, R, 5>(x, K, w + p * K * NB, out + p * NB, n, n - p * NB);
  if constexpr (QR > 4) if (left == 4) row_block<W, R, 4>(x, K, w + p * K * NB, out + p * NB, n, n - p * NB);
  if constexpr (QR > 3) if (left == 3) row_block<W, R, 3>(x, K, w + p * K * NB, out + p * NB, n, n - p * NB);
  if constexpr (QR > 2) if (left == 2) row_block<W, R, 2>(x, K, w + p * K * NB, out + p * NB, n, n - p * NB);
  if constexpr (QR > 1) if (left == 1) row_block<W, R, 1>(x, K, w + p * K * NB, out + p * NB, n, n - p * NB);
}

// A few rows (SMALL_ROWS at most) against panels p0 .. p1-1: two rows at a time, then one.
template <typename W>
void rows_vector(const float* x, int64_t M, int64_t K, const W* w, int64_t p0, int64_t p1, float* out, int64_t n) {
  int64_t m = 0;
  for (; m + 2 <= M; m += 2) row_blocks<W, 2>(x + m * K, K, w, p0, p1, out + m * n, n);
  if (m < M) row_blocks<W, 1>(x + m * K, K, w, p0, p1, out + m * n, n);
}

template <typename W>
void panel_vector(const float* x, int64_t K, const W* w, int64_t rows, float* out, int64_t ldo, int64_t cols) {
  int64_t m = 0;
  for (; m + MR <= rows; m += MR) block<W, MR>(x + m * K, K, w, out + m * ldo, ldo, cols);
  switch (rows - m) {
    case 5: block<W, 5>(x + m * K, K, w, out + m * ldo, ldo, cols); break;
    case 4: block<W, 4>(x + m * K, K, w, out + m * ldo, ldo, cols); break;
    case 3: block<W, 3>(x + m * K, K, w, out + m * ldo, ldo, cols); break;
    case 2: block<W, 2>(x + m * K, K, w, out + m * ldo, ldo, cols); break;
    case 1: block<W, 1>(x + m * K, K, w, out + m * ldo, ldo, cols); break;
    default: break;
  }
}
#endif

template <typename W>
void run(const float* x, int64_t M, int64_t K, const W* w, int64_t panels, float* out, int64_t n, bool vector) {
  // grain: about 64K multiply-adds a task, so the draft's small linears stay on one thread
  int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, M * K * NB));
  torch::stable::parallel_for(0, panels, grain, [&](int64_t begin, int64_t end) {
#ifdef SAGUARO_AVX2
    if (vector && M <= SMALL_ROWS) {
      rows_vector(x, M, K, w, begin, end, out, n);
      return;
    }
#endif
    for (int64_t p = begin; p < end; ++p) {
      const W* wp = w + p * K * NB;
      int64_t cols = std::min<int64_t>(NB, n - p * NB);
#ifdef SAGUARO_AVX2
      if (vector) {
        panel_vector(x, K, wp, M, out + p * NB, n, cols);
        continue;
      }
#endif
      panel_scalar(x, K, wp, M, out + p * NB, n, cols);
    }
  });
}

void check(bool ok, const char* message) {
  if (!ok) throw std::runtime_error(message);
}

torch::stable::Tensor packed_linear_impl(const torch::stable::Tensor& x_in, const torch::stable::Tensor& packed,
                                         int64_t n, bool vector) {
  using torch::headeronly::ScalarType;
  check(x_in.dim() == 2 && x_in.scalar_type() == ScalarType::Float, "packed_linear: x must be [M, K] float32");
  check(packed.dim() == 3 && packed.size(2) == NB && packed.size(1) == x_in.size(1) && packed.is_contiguous(),
        "packed_linear: packed must be a contiguous [P, K, 16] panel tensor of x's K");
  check(n > (packed.size(0) - 1) * NB && n <= packed.size(0) * NB, "packed_linear: n does not fit the panels");
  torch::stable::Tensor x = saguaro::contiguous_of(x_in);
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  torch::stable::Tensor out = saguaro::new_float(x, {M, n});
  if (M == 0) return out;
  const float* xp = static_cast<const float*>(x.const_data_ptr());
  float* op = static_cast<float*>(out.mutable_data_ptr());
  const void* wp = packed.const_data_ptr();
  switch (packed.scalar_type()) {
    case ScalarType::Float: run(xp, M, K, static_cast<const float*>(wp), panels, op, n, vector); break;
    case ScalarType::Half: run(xp, M, K, static_cast<const Half*>(wp), panels, op, n, vector); break;
    case ScalarType::BFloat16: run(xp, M, K, static_cast<const Brain*>(wp), panels, op, n, vector); break;
    default: check(false, "packed_linear: packed must be float32, float16 or bfloat16");
  }
  return out;
}

torch::stable::Tensor packed_linear(torch::stable::Tensor x, torch::stable::Tensor packed, int64_t n) {
  return packed_linear_impl(x, packed, n, true);
}

torch::stable::Tensor packed_linear_scalar(torch::stable::Tensor x, torch::stable::Tensor packed, int64_t n) {
  return packed_linear_impl(x, packed, n, false);
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
  m.def("vectorised() -> bool");
}

STABLE_TORCH_LIBRARY_IMPL(saguaro_kernels, CPU, m) {
  m.impl("packed_linear", TORCH_BOX(&packed_linear));
  m.impl("packed_linear_scalar", TORCH_BOX(&packed_linear_scalar));
}

STABLE_TORCH_LIBRARY_IMPL(saguaro_kernels, CompositeExplicitAutograd, m) { m.impl("vectorised", TORCH_BOX(&vectorised)); }
