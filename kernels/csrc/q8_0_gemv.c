/* Logits from a GGUF's Q8_0 blocks: out[b, v] = sum_g s[v, g] * sum_k q[v, 32g + k] * x[b, 32g + k].
 *
 * Weights stay the file's values (int8, one fp32 scale per 32), repacked once by
 * `q8_0_pack` into tiles of 16 rows so that one vector lane holds one row: per tile and
 * block g, 16 pairs p of columns (2p, 2p + 1), each 16 rows x 2 int8 (32 bytes), then the
 * tile's 16 scales of block g. A step's activations are quantized per 32-block to int16
 * (scale = the block's largest |x| / 32767: each value off by at most 2^-16 of that
 * largest, far finer than bf16's own rounding). A block's products are integer multiply-
 * adds of int16 pairs summed in int32 (|sum| <= 32 * 127 * 32767 < 2^31), then scaled
 * and summed in fp32: per 512 weights one int->float conversion and one FMA for all 16
 * rows, where a row-major layout needs one per row.
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
 * multiple of 16): pq [padded * H] int8, ps [padded * H / 32] fp32. Block g of row r holds
 * q[r * row_stride + g * block_stride + k] (k < 32), so the values are read where they lie:
 * row-major (H, 32) or in a GGUF's own 34-byte Q8_0 records (34 * H / 32, 34); its scale is
 * s[r * H / 32 + g]. */
void q8_0_pack(const int8_t* q, int64_t row_stride, int64_t block_stride, const float* s,
               int64_t rows, int64_t padded, int64_t H, int8_t* pq, float* ps) {
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
        ps[(t * ng + g) * TILE + j] = r < rows ? s[r * ng + g] : 0.0f;
      }
    }
  }
}

static void quantize_rows(const float* x, int64_t B, int64_t H, int16_t* x16, float* xs) {
  const int64_t ng = H / BLOCK;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < ng; ++g) {
      const float* src = x + b * H + g * BLOCK;
      int16_t* dst = x16 + b * H + g * BLOCK;
      float m = 0.0f;
      int finite = 1;
      for (int k = 0; k < BLOCK; ++k) {
        finite &= isfinite(src[k]) != 0;
        m = fmaxf(m, fabsf(src[k]));
      }
      const float inv = finite && m > 0.0f ? 32767.0f / m : 0.0f;
      for (int k = 0; k < BLOCK; ++k) dst[k] = (int16_t)lrintf(src[k] * inv);
      xs[b * ng + g] = finite ? m / 32767.0f : NAN; /* a NaN or inf in: NaN logits out */
    }
  }
}

/* Columns 2p and 2p + 1 of an activation block, as one int32 (for a broadcast). */
static inline int32_t column_pair(const int16_t* block, int p) {
  int32_t pair;
  memcpy(&pair, block + 2 * p, sizeof pair);
  return pair;
}

#if defined(__AVX512BW__)
#define ROWS_PER_PASS 4
/* One tile, activation rows [0, nb) of x16 (row stride H): out[b * V + 16 rows]. */
static void tile_product(const int8_t* w, const float* sc, const int16_t* x16, const float* xs,
                         int64_t H, int64_t V, int nb, float* out) {
  const int64_t ng = H / BLOCK;
  __m512 acc[ROWS_PER_PASS];
  for (int b = 0; b < nb; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g, w += TILE_BLOCK_BYTES, sc += TILE) {
    __m512i dot[ROWS_PER_PASS];
    for (int b = 0; b < nb; ++b) dot[b] = _mm512_setzero_si512();
    for (int p = 0; p < PAIRS; ++p) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + p * 2 * TILE)));
      for (int b = 0; b < nb; ++b) {
        const __m512i xv = _mm512_set1_epi32(column_pair(x16 + b * H + g * BLOCK, p));
#if defined(__AVX512VNNI__)
        dot[b] = _mm512_dpwssd_epi32(dot[b], wv, xv);
#else
        dot[b] = _mm512_add_epi32(dot[b], _mm512_madd_epi16(wv, xv));
#endif
      }
    }
    const __m512 sv = _mm512_loadu_ps(sc);
    for (int b = 0; b < nb; ++b) {
      const __m512 scale = _mm512_mul_ps(sv, _mm512_set1_ps(xs[b * ng + g]));
      acc[b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[b]), scale, acc[b]);
    }
  }
  for (int b = 0; b < nb; ++b) _mm512_storeu_ps(out + b * V, acc[b]);
}
#elif defined(__AVX2__)
#define ROWS_PER_PASS 2
static void tile_product(const int8_t* w, const float* sc, const int16_t* x16, const float* xs,
                         int64_t H, int64_t V, int nb, float* out) {
  const int64_t ng = H / BLOCK;
  __m256 acc[ROWS_PER_PASS][2];
  for (int b = 0; b < nb; ++b) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g, w += TILE_BLOCK_BYTES, sc += TILE) {
    __m256i dot[ROWS_PER_PASS][2];
    for (int b = 0; b < nb; ++b) dot[b][0] = dot[b][1] = _mm256_setzero_si256();
    for (int p = 0; p < PAIRS; ++p) {
      const int8_t* wp = w + p * 2 * TILE;
      const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)wp));  /* rows 0-7 */
      const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wp + 16)));
      for (int b = 0; b < nb; ++b) {
        const __m256i xv = _mm256_set1_epi32(column_pair(x16 + b * H + g * BLOCK, p));
        dot[b][0] = _mm256_add_epi32(dot[b][0], _mm256_madd_epi16(lo, xv));
        dot[b][1] = _mm256_add_epi32(dot[b][1], _mm256_madd_epi16(hi, xv));
      }
    }
    for (int b = 0; b < nb; ++b) {
      const __m256 xsv = _mm256_set1_ps(xs[b * ng + g]);
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = _mm256_mul_ps(_mm256_loadu_ps(sc + 8 * h), xsv);
        acc[b][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[b][h]), scale, acc[b][h]);
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
static void tile_product(const int8_t* w, const float* sc, const int16_t* x16, const float* xs,
                         int64_t H, int64_t V, int nb, float* out) {
  const int64_t ng = H / BLOCK;
  (void)nb; /* one row a pass */
  (void)V;
  float acc[TILE] = {0};
  for (int64_t g = 0; g < ng; ++g, w += TILE_BLOCK_BYTES, sc += TILE) {
    int32_t dot[TILE] = {0};
    for (int p = 0; p < PAIRS; ++p) {
      const int16_t x0 = x16[g * BLOCK + 2 * p], x1 = x16[g * BLOCK + 2 * p + 1];
      for (int j = 0; j < TILE; ++j)
        dot[j] += (int32_t)w[p * 2 * TILE + 2 * j] * x0 + (int32_t)w[p * 2 * TILE + 2 * j + 1] * x1;
    }
    for (int j = 0; j < TILE; ++j) acc[j] += (float)dot[j] * (sc[j] * xs[g]);
  }
  for (int j = 0; j < TILE; ++j) out[j] = acc[j];
}
#endif

/* Returns 0, or -1 when the scratch memory cannot be had (nothing written). `threads`: the
 * caller's torch thread count (an OpenMP runtime other than torch's would not know it). */
int q8_0_gemv(const float* x, int64_t B, int64_t H, const int8_t* pq, const float* ps, int64_t V,
              float* out, int threads) {
  if (B <= 0 || V <= 0) return 0;
  const int64_t ng = H / BLOCK;
  int16_t* x16 = (int16_t*)malloc((size_t)(B * H) * sizeof(int16_t));
  float* xs = (float*)malloc((size_t)(B * ng) * sizeof(float));
  if (x16 == NULL || xs == NULL) {
    free(x16);
    free(xs);
    return -1;
  }
  quantize_rows(x, B, H, x16, xs);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < V / TILE; ++t) {
    for (int64_t b = 0; b < B; b += ROWS_PER_PASS) {
      const int nb = (int)(B - b < ROWS_PER_PASS ? B - b : ROWS_PER_PASS);
      tile_product(pq + t * ng * TILE_BLOCK_BYTES, ps + t * ng * TILE, x16 + b * H, xs + b * ng,
                   H, V, nb, out + b * V + t * TILE);
    }
  }
  free(x16);
  free(xs);
  return 0;
}
