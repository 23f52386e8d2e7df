// The weight dtypes packed_linear.cpp reads and how a panel's columns widen to float32.
//
// A panel holds NB = 64 output columns; row k of a panel is the 64 weights that multiply x[k]. Stored kinds:
// float32, float16, bfloat16 (widened exactly), int8 (signed, [P, K, 64]) and int4 (two k rows per byte row,
// [P, K/2, 64]: the low nibble k even, the high nibble k odd, each the value plus 8, so 0..15 holds -8..7).
// A quantized weight's value is float(q) * scale[g, c], rounded once in float32, g = k / group: the same float32
// weight the Python reference dequantizes, so a quantized panel's outputs are its dequantized weight's.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SAGUARO_AVX2 1
#endif
#if defined(SAGUARO_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define SAGUARO_AVX512 1
#endif

namespace saguaro {

constexpr int64_t NB = 64;  // output columns per panel
constexpr int64_t NV = 4;   // 16-column vectors per panel row

struct Half { uint16_t bits; };   // float16, as stored
struct Brain { uint16_t bits; };  // bfloat16, as stored
struct Nibbles { uint8_t bits; }; // two int4 values (k even low, k odd high), each stored plus 8

inline float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float widen(float v) { return v; }
inline float widen(int8_t v) { return float(v); }
inline float widen(Brain v) { return from_bits(uint32_t{v.bits} << 16); }
inline float widen(Half v) {  // exact: every float16 value is a float32 value
  uint32_t sign = uint32_t{v.bits & 0x8000u} << 16, exponent = (v.bits >> 10) & 0x1f, mantissa = v.bits & 0x3ffu;
  if (exponent == 0x1f) return from_bits(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return from_bits(sign);
  int shift = 0;  // subnormal: normalise
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  return from_bits(sign | uint32_t(113 - shift) << 23 | ((mantissa & 0x3ffu) << 13));
}

// Where row k of a panel starts, in elements of the stored type, and the scalar value of column c.
template <typename W> constexpr int64_t row_offset(int64_t k) { return k * NB; }
template <> constexpr int64_t row_offset<Nibbles>(int64_t k) { return (k >> 1) * NB; }
template <typename W> inline float weight_at(const W* panel, int64_t k, int64_t c) {
  return widen(panel[row_offset<W>(k) + c]);
}
template <> inline float weight_at<Nibbles>(const Nibbles* panel, int64_t k, int64_t c) {
  uint8_t byte = panel[row_offset<Nibbles>(k) + c].bits;
  return float(int((k & 1) ? (byte >> 4) : (byte & 0xf)) - 8);
}
// Rows of the stored tensor per panel for K weights' rows.
template <typename W> constexpr int64_t stored_rows(int64_t K) { return K; }
template <> constexpr int64_t stored_rows<Nibbles>(int64_t K) { return (K + 1) / 2; }

#ifdef SAGUARO_AVX2
// 16 columns (j-th vector) of panel row k, widened: two AVX2 registers.
inline void load16(const float* row, int j, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(row + 16 * j);
  hi = _mm256_loadu_ps(row + 16 * j + 8);
}
inline void load16(const Half* row, int j, __m256& lo, __m256& hi) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * j));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
inline void load16(const Brain* row, int j, __m256& lo, __m256& hi) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * j));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(h)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(h, 1)), 16));
}
inline void load16(const int8_t* row, int j, __m256& lo, __m256& hi) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j));
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}
// `row` is the byte row of k's pair; `odd` picks the high nibbles.
inline void load16(const Nibbles* row, int j, bool odd, __m256& lo, __m256& hi) {
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j));
  if (odd) b = _mm_srli_epi16(b, 4);
  b = _mm_and_si128(b, _mm_set1_epi8(0x0f));
  const __m256 eight = _mm256_set1_ps(8.f);
  lo = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), eight);
  hi = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))), eight);
}

inline void store16(float* out, __m256 lo, __m256 hi, int64_t cols) {
  if (cols >= 16) {
    _mm256_storeu_ps(out, lo);
    _mm256_storeu_ps(out + 8, hi);
  } else if (cols > 0) {
    alignas(32) float tmp[16];
    _mm256_store_ps(tmp, lo);
    _mm256_store_ps(tmp + 8, hi);
    std::memcpy(out, tmp, cols * sizeof(float));
  }
}
#endif

#ifdef SAGUARO_AVX512
// The whole panel row k (64 columns) widened into four AVX-512 registers.
inline void load64(const float* row, __m512 v[NV]) {
  for (int j = 0; j < NV; ++j) v[j] = _mm512_loadu_ps(row + 16 * j);
}
inline void load64(const Half* row, __m512 v[NV]) {
  for (int j = 0; j < NV; ++j) v[j] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * j)));
}
inline void load64(const Brain* row, __m512 v[NV]) {
  for (int j = 0; j < NV; ++j) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * j));
    v[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}
inline void load64(const int8_t* row, __m512 v[NV]) {
  for (int j = 0; j < NV; ++j)
    v[j] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * j))));
}
#endif

}  // namespace saguaro
