/* Products with weights held as int8 blocks of 32: out[b, v] = sum_g sum_k w[v, 32g + k] * x[b, 32g + k]
 * with w[v, 32g + k] = s[v, g, k / (32 / nsub)] * q[v, 32g + k] - m[v, g] (m = 0 without mins).
 *
 * Q8_0 (one scale a block: nsub = 1, no mins) is a GGUF's Q8_0, Q5_0 and Q4_0 blocks; a scale
 * per 16 (nsub = 2) holds Q6_K's sub-blocks and a minimum per block Q4_K's, each exactly.
 * Weights stay the file's values (int8; scales and minimums fp32, or the scales fp16 where
 * the file's are (`half`: one a block, no minimums), so a step reads 2 bytes a scale, not
 * 4; converted in registers, exactly), repacked once by
 * `q8_0_pack` into tiles of 16 rows so that one vector lane holds one row: per tile and
 * block g, 16 pairs p of columns (2p, 2p + 1), each 16 rows x 2 int8 (32 bytes), then the
 * tile's scales (nsub x 16) and minimums (16) of block g. A step's activations are quantized
 * per 32-block to int16 (scale = the block's largest |x| / 32767: each value off by at most
 * 2^-16 of that largest, far finer than bf16's own rounding). A block's products are
 * integer multiply-adds of int16 pairs summed in int32 (|sum| <= 32 * 127 * 32767 < 2^31),
 * then scaled and summed in fp32: per 512 weights one int->float conversion and one FMA for
 * all 16 rows per sub-block (a minimum adds one FMA with the block's activation sum), where
 * a row-major layout needs one per row.
 *
 * Built at first use with the machine's own instruction set (-march=native): AVX-512BW
 * (with VNNI's fused multiply-add where the CPU has it), else AVX2, else plain C. Tiles are
 * split across `threads` OpenMP threads (torch's own team where the runtime is its libgomp).
 * Layout: x [B, H] fp32, out [B, V] fp32, contiguous; H % 32 == 0, V % 16 == 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 32
#define TILE 16
#define PAIRS (BLOCK / 2)
#define TILE_BLOCK_BYTES (PAIRS * TILE * 2) /* 512 */

/* An fp16 value's bits as a float (exact: every fp16 value is one). */
static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13); /* inf, NaN */
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else { /* subnormal: man * 2^-24, normalized */
    uint32_t e = 113u;
    while (!(man & 0x400u)) {
      man <<= 1;
      --e;
    }
    bits = sign | (e << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

/* The instruction set of this build: 3 AVX-512 VNNI, 2 AVX-512BW, 1 AVX2, 0 plain C. */
int q8_0_isa(void) {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return 3;
#elif defined(__AVX512BW__)
  return 2;
#elif defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

/* Rows [0, rows) of a weight into the tiled layout, padded with zero rows to `padded` (a
 * multiple of 16): pq [padded * H] int8, ps [padded * H / 32 * nsub] fp32 (fp16 with `half`:
 * then s is fp16 too) and, with `m`, pm [padded * H / 32] fp32. Block g of row r holds
 * q[r * row_stride + g * block_stride + k] (k < 32), so the values are read where they lie:
 * row-major (H, 32) or in a GGUF's own 34-byte Q8_0 records (34 * H / 32, 34); its scales
 * are s[(r * H / 32 + g) * nsub + i] and its minimum m[r * H / 32 + g]. */
void q8_0_pack(const int8_t* q, int64_t row_stride, int64_t block_stride, const void* s,
               int nsub, int half, const float* m, int64_t rows, int64_t padded, int64_t H,
               int8_t* pq, void* ps, float* pm) {
  const int64_t ng = H / BLOCK;
  for (int64_t t = 0; t < padded / TILE; ++t) {
    for (int64_t g = 0; g < ng; ++g) {
      int8_t* dst = pq + (t * ng + g) * TILE_BLOCK_BYTES;
      for (int j = 0; j < TILE; ++j) {
        const int64_t r = t * TILE + j;
        const int8_t* src = r < rows ? q + r * row_stride + g * block_stride : NULL;
        for (int p = 0; p < PAIRS; ++p) {
          dst[p * 2 * TILE + 2 * j] = src ? src[2 * p] : 0;
          dst[p * 2 * TILE + 2 * j + 1] = src ? src[2 * p + 1] : 0;
        }
        for (int i = 0; i < nsub; ++i) {
          const int64_t to = ((t * ng + g) * nsub + i) * TILE + j, from = (r * ng + g) * nsub + i;
          if (half)
            ((uint16_t*)ps)[to] = r < rows ? ((const uint16_t*)s)[from] : 0;
          else
            ((float*)ps)[to] = r < rows ? ((const float*)s)[from] : 0.0f;
        }
        if (m) pm[(t * ng + g) * TILE + j] = r < rows ? m[r * ng + g] : 0.0f;
      }
    }
  }
}

/* One block of 32 activations: dst[k] = rint(src[k] * (32767 / m)), m the block's largest
 * |value|; returns the sum of dst and sets *scale = m / 32767. A block holding a NaN or an
 * infinity quantizes to zeros with a NaN scale (NaN logits out); one so small that
 * 32767 / m overflows, to zeros. The vector paths do the
 * scalar one's float operations in its order and round as lrintf does (to nearest even,
 * the default mode): the same values. */
static inline int32_t quantize_block(const float* src, int16_t* dst, float* scale) {
  float m;
  int finite;
#if defined(__AVX512F__)
  const __m512 lo = _mm512_loadu_ps(src), hi = _mm512_loadu_ps(src + 16);
  const __m512 alo = _mm512_abs_ps(lo), ahi = _mm512_abs_ps(hi);
  const __m512 inf = _mm512_set1_ps(INFINITY);
  finite = (_mm512_cmp_ps_mask(alo, inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(ahi, inf, _CMP_LT_OQ)) ==
           0xFFFF;
  m = _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi));
#elif defined(__AVX2__)
  __m256 v[4], mx = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 inf = _mm256_set1_ps(INFINITY);
  finite = 1;
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(src + 8 * j);
    const __m256 a = _mm256_and_ps(v[j], magnitude);
    finite &= _mm256_movemask_ps(_mm256_cmp_ps(a, inf, _CMP_LT_OQ)) == 0xFF;
    mx = _mm256_max_ps(mx, a);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  m = _mm_cvtss_f32(m4);
#else
  m = 0.0f;
  finite = 1;
  for (int k = 0; k < BLOCK; ++k) {
    finite &= isfinite(src[k]) != 0;
    m = fmaxf(m, fabsf(src[k]));
  }
#endif
  if (!finite) {
    memset(dst, 0, BLOCK * sizeof(int16_t));
    *scale = NAN;
    return 0;
  }
  const float inv = m > 0.0f ? 32767.0f / m : 0.0f;
  *scale = m / 32767.0f;
  if (isinf(inv)) { /* m below ~1e-34: every value rounds to 0 (as the scalar loop's) */
    memset(dst, 0, BLOCK * sizeof(int16_t));
    return 0;
  }
#if defined(__AVX512F__)
  const __m512 iv = _mm512_set1_ps(inv);
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, iv));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, iv));
  _mm256_storeu_si256((__m256i*)dst, _mm512_cvtepi32_epi16(qlo));
  _mm256_storeu_si256((__m256i*)(dst + 16), _mm512_cvtepi32_epi16(qhi));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#elif defined(__AVX2__)
  const __m256 iv = _mm256_set1_ps(inv);
  __m256i q[4], sum = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], iv));
    sum = _mm256_add_epi32(sum, q[j]);
  }
  /* |q| <= 32767: the saturating pack is exact; it interleaves 128-bit lanes, hence 0xD8 */
  for (int j = 0; j < 4; j += 2)
    _mm256_storeu_si256((__m256i*)(dst + 8 * j),
                        _mm256_permute4x64_epi64(_mm256_packs_epi32(q[j], q[j + 1]), 0xD8));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  return _mm_cvtsi128_si32(s4);
#else
  int32_t total = 0;
  for (int k = 0; k < BLOCK; ++k) {
    dst[k] = (int16_t)lrintf(src[k] * inv);
    total += dst[k];
  }
  return total;
#endif
}

/* x16 and xs as the header says; xsum[b, g] = xs * sum_k x16[b, 32g + k] (for minimums). */
static void quantize_rows(const float* x, int64_t B, int64_t H, int16_t* x16, float* xs,
                          float* xsum) {
  const int64_t ng = H / BLOCK;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t at = b * ng + g;
      const int32_t total = quantize_block(x + at * BLOCK, x16 + at * BLOCK, xs + at);
      xsum[at] = xs[at] * (float)total;
    }
  }
}

/* Columns 2p and 2p + 1 of an activation block, as one int32 (for a broadcast). */
static inline int32_t column_pair(const int16_t* block, int p) {
  int32_t pair;
  memcpy(&pair, block + 2 * p, sizeof pair);
  return pair;
}

/* One tile, activation rows [0, nb) of x16 (row stride H): out[b * V + 16 rows]. `sc`: the
 * tile's scales (nsub x 16 a block; fp16 with `half`, else fp32), `mn`: its minimums (16 a
 * block) or NULL. Inlined with constant `nb`, `nsub`, `half` and `mn` presence, so each
 * kind of block and row count gets loops of its own, its sums in registers.
 * A pass of few rows sums a block in several independent registers a row (chains): each
 * multiply-add waits for the one before it into the same register, so one row in one
 * register would wait on the instruction's latency instead of issuing at its throughput. */
#if defined(__AVX512BW__)
#define ROWS_PER_PASS 4
#define CHAINS(nb) ((nb) == 1 ? 4 : (nb) == 2 ? 2 : 1)
static inline __attribute__((always_inline)) void tile_kernel(
    const int8_t* w, const void* sc, const int nsub, const int half, const float* mn,
    const int16_t* x16, const float* xs, const float* xsum, int64_t H, int64_t V, const int nb,
    float* out) {
  const int64_t ng = H / BLOCK;
  const int per = PAIRS / nsub;
  const int chains = CHAINS(nb);
  __m512 acc[ROWS_PER_PASS];
  for (int b = 0; b < nb; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g, w += TILE_BLOCK_BYTES) {
    for (int i = 0; i < nsub; ++i) {
      __m512i dot[ROWS_PER_PASS][4];
      for (int b = 0; b < nb; ++b)
        for (int c = 0; c < chains; ++c) dot[b][c] = _mm512_setzero_si512();
      for (int p = i * per; p < (i + 1) * per; ++p) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + p * 2 * TILE)));
        const int c = p % chains;
        for (int b = 0; b < nb; ++b) {
          const __m512i xv = _mm512_set1_epi32(column_pair(x16 + b * H + g * BLOCK, p));
#if defined(__AVX512VNNI__)
          dot[b][c] = _mm512_dpwssd_epi32(dot[b][c], wv, xv);
#else
          dot[b][c] = _mm512_add_epi32(dot[b][c], _mm512_madd_epi16(wv, xv));
#endif
        }
      }
      for (int b = 0; b < nb; ++b)
        for (int c = 1; c < chains; ++c) dot[b][0] = _mm512_add_epi32(dot[b][0], dot[b][c]);
      const int64_t so = (g * nsub + i) * TILE;
      const __m512 sv =
          half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)sc + so)))
               : _mm512_loadu_ps((const float*)sc + so);
      for (int b = 0; b < nb; ++b) {
        const __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(xs[b * ng + g]));
        acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[b][0]), scale, acc[b]);
      }
    }
    if (mn) {
      const __m512 mv = _mm512_loadu_ps(mn + g * TILE);
      for (int b = 0; b < nb; ++b)
        acc[b] = _mm512_fnmadd_ps(mv, _mm512_set1_ps(xsum[b * ng + g]), acc[b]);
    }
  }
  for (int b = 0; b < nb; ++b) _mm512_storeu_ps(out + b * V, acc[b]);
}
#elif defined(__AVX2__)
#define ROWS_PER_PASS 2
/* Eight scales from so on, fp32 or fp16. */
static inline __attribute__((always_inline)) __m256 load_scales8(const void* sc, int64_t so,
                                                                  const int half) {
  if (!half) return _mm256_loadu_ps((const float*)sc + so);
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)sc + so)));
#else
  float f[8];
  for (int j = 0; j < 8; ++j) f[j] = half_to_float(((const uint16_t*)sc)[so + j]);
  return _mm256_loadu_ps(f);
#endif
}

static inline __attribute__((always_inline)) void tile_kernel(
    const int8_t* w, const void* sc, const int nsub, const int half, const float* mn,
    const int16_t* x16, const float* xs, const float* xsum, int64_t H, int64_t V, const int nb,
    float* out) {
  const int64_t ng = H / BLOCK;
  const int per = PAIRS / nsub;
  const int chains = nb == 1 ? 2 : 1; /* with the two halves' own: 4 for one row, 2 a row */
  __m256 acc[ROWS_PER_PASS][2];
  for (int b = 0; b < nb; ++b) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g, w += TILE_BLOCK_BYTES) {
    for (int i = 0; i < nsub; ++i) {
      __m256i dot[ROWS_PER_PASS][2][2];
      for (int b = 0; b < nb; ++b)
        for (int c = 0; c < chains; ++c) dot[b][0][c] = dot[b][1][c] = _mm256_setzero_si256();
      for (int p = i * per; p < (i + 1) * per; ++p) {
        const int8_t* wp = w + p * 2 * TILE;
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)wp));  /* rows 0-7 */
        const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wp + 16)));
        const int c = p % chains;
        for (int b = 0; b < nb; ++b) {
          const __m256i xv = _mm256_set1_epi32(column_pair(x16 + b * H + g * BLOCK, p));
          dot[b][0][c] = _mm256_add_epi32(dot[b][0][c], _mm256_madd_epi16(lo, xv));
          dot[b][1][c] = _mm256_add_epi32(dot[b][1][c], _mm256_madd_epi16(hi, xv));
        }
      }
      for (int b = 0; b < nb; ++b)
        for (int c = 1; c < chains; ++c)
          for (int h = 0; h < 2; ++h) dot[b][h][0] = _mm256_add_epi32(dot[b][h][0], dot[b][h][c]);
      for (int b = 0; b < nb; ++b) {
        const __m256 xsv = _mm256_set1_ps(xs[b * ng + g]);
        for (int h = 0; h < 2; ++h) {
          const __m256 scale =
              _mm256_mul_ps(load_scales8(sc, (g * nsub + i) * TILE + 8 * h, half), xsv);
          acc[b][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[b][h][0]), scale, acc[b][h]);
        }
      }
    }
    if (mn) {
      for (int b = 0; b < nb; ++b) {
        const __m256 total = _mm256_set1_ps(xsum[b * ng + g]);
        for (int h = 0; h < 2; ++h)
          acc[b][h] = _mm256_fnmadd_ps(_mm256_loadu_ps(mn + g * TILE + 8 * h), total, acc[b][h]);
      }
    }
  }
  for (int b = 0; b < nb; ++b) {
    _mm256_storeu_ps(out + b * V, acc[b][0]);
    _mm256_storeu_ps(out + b * V + 8, acc[b][1]);
  }
}
#else
#define ROWS_PER_PASS 1
static inline void tile_kernel(const int8_t* w, const void* sc, const int nsub, const int half,
                               const float* mn, const int16_t* x16, const float* xs,
                               const float* xsum, int64_t H, int64_t V, const int nb, float* out) {
  const int64_t ng = H / BLOCK;
  const int per = PAIRS / nsub;
  (void)nb; /* one row a pass */
  (void)V;
  float acc[TILE] = {0};
  for (int64_t g = 0; g < ng; ++g, w += TILE_BLOCK_BYTES) {
    for (int i = 0; i < nsub; ++i) {
      const int64_t so = (g * nsub + i) * TILE;
      int32_t dot[TILE] = {0};
      for (int p = i * per; p < (i + 1) * per; ++p) {
        const int16_t x0 = x16[g * BLOCK + 2 * p], x1 = x16[g * BLOCK + 2 * p + 1];
        for (int j = 0; j < TILE; ++j)
          dot[j] += (int32_t)w[p * 2 * TILE + 2 * j] * x0 + (int32_t)w[p * 2 * TILE + 2 * j + 1] * x1;
      }
      for (int j = 0; j < TILE; ++j) {
        const float scale = half ? half_to_float(((const uint16_t*)sc)[so + j])
                                 : ((const float*)sc)[so + j];
        acc[j] += (float)dot[j] * (scale * xs[g]);
      }
    }
    if (mn)
      for (int j = 0; j < TILE; ++j) acc[j] -= mn[g * TILE + j] * xsum[g];
  }
  for (int j = 0; j < TILE; ++j) out[j] = acc[j];
}
#endif

/* The kinds of blocks, each with its own loops: Q8_0's (fp32 or fp16 scales); a scale per 16
 * (Q6_K); minimums (Q4_K); both. Each for every row count of a pass. */
typedef void (*tile_fn)(const int8_t*, const void*, const float*, const int16_t*, const float*,
                        const float*, int64_t, int64_t, int, float*);
#define ROWS_CASE(N, NSUB, HALF, MN)                                      \
  case N:                                                                 \
    tile_kernel(w, sc, NSUB, HALF, MN, x16, xs, xsum, H, V, N, out);      \
    break;
#if ROWS_PER_PASS >= 4
#define ROWS_3_4(NSUB, HALF, MN) ROWS_CASE(3, NSUB, HALF, MN) ROWS_CASE(4, NSUB, HALF, MN)
#else
#define ROWS_3_4(NSUB, HALF, MN)
#endif
#if ROWS_PER_PASS >= 2
#define ROWS_2(NSUB, HALF, MN) ROWS_CASE(2, NSUB, HALF, MN)
#else
#define ROWS_2(NSUB, HALF, MN)
#endif
#define TILE_FN(NAME, NSUB, HALF, MINS)                                                       \
  static void NAME(const int8_t* w, const void* sc, const float* mn, const int16_t* x16,     \
                   const float* xs, const float* xsum, int64_t H, int64_t V, int nb,          \
                   float* out) {                                                              \
    (void)mn;                                                                                 \
    switch (nb) {                                                                             \
      ROWS_3_4(NSUB, HALF, MINS ? mn : NULL)                                                  \
      ROWS_2(NSUB, HALF, MINS ? mn : NULL)                                                    \
      default:                                                                                \
        tile_kernel(w, sc, NSUB, HALF, MINS ? mn : NULL, x16, xs, xsum, H, V, 1, out);        \
    }                                                                                         \
  }
TILE_FN(tile_q8_0, 1, 0, 0)
TILE_FN(tile_q8_0_half, 1, 1, 0)
TILE_FN(tile_sub16, 2, 0, 0)
TILE_FN(tile_mins, 1, 0, 1)
TILE_FN(tile_sub16_mins, 2, 0, 1)

/* Returns 0, or -1 when the scratch memory cannot be had (nothing written), -2 for an nsub
 * other than 1 or 2, or fp16 scales (`half`) with sub-blocks or minimums. `threads`: the
 * caller's torch thread count (an OpenMP runtime other than torch's would not know it).
 * `pm`: the packed minimums, or NULL. */
int q8_0_gemv(const float* x, int64_t B, int64_t H, const int8_t* pq, const void* ps, int nsub,
              int half, const float* pm, int64_t V, float* out, int threads) {
  if ((nsub != 1 && nsub != 2) || (half && (nsub != 1 || pm))) return -2;
  if (B <= 0 || V <= 0) return 0;
  const int64_t ng = H / BLOCK;
  int16_t* x16 = (int16_t*)malloc((size_t)(B * H) * sizeof(int16_t));
  float* xs = (float*)malloc((size_t)(B * ng) * sizeof(float));
  float* xsum = (float*)malloc((size_t)(B * ng) * sizeof(float));
  if (x16 == NULL || xs == NULL || xsum == NULL) {
    free(x16);
    free(xs);
    free(xsum);
    return -1;
  }
  quantize_rows(x, B, H, x16, xs, xsum);
  const tile_fn tile = half ? tile_q8_0_half
                       : nsub == 1 ? (pm ? tile_mins : tile_q8_0)
                                   : (pm ? tile_sub16_mins : tile_sub16);
  const int64_t scale_bytes = half ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < V / TILE; ++t) {
    for (int64_t b = 0; b < B; b += ROWS_PER_PASS) {
      const int nb = (int)(B - b < ROWS_PER_PASS ? B - b : ROWS_PER_PASS);
      tile(pq + t * ng * TILE_BLOCK_BYTES, (const char*)ps + t * ng * nsub * TILE * scale_bytes,
           pm ? pm + t * ng * TILE : NULL,
           x16 + b * H, xs + b * ng, xsum + b * ng, H, V, nb, out + b * V + t * TILE);
    }
  }
  free(x16);
  free(xs);
  free(xsum);
  return 0;
}
