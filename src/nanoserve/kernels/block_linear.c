/* y = x W^T with W stored in blocks of 4-bit or 8-bit integers: a streaming kernel for small batches
 * and a small GEMM for decode batches of up to ~64 rows (block_gemm_f32, below).
 * 4-bit: each row of W is cut into blocks of 32
 * weights, each block holds w = d * q + m with q in 0..15 (16 bytes of nibbles: byte j has weight j in
 * its low nibble and weight j + 16 in its high nibble), d and m float16 (as in a GGUF Q4_1 block). A
 * row then streams 20 bytes per 32 weights instead of 128, which bounds a decode step with few rows. */
#include "simd.h"
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

/* The 8 partial sums of 32 activations times one block's 32 weights (as 4 vectors of 8 floats). */
static inline __m256 dot32(const float *xr, __m256 q0, __m256 q1, __m256 q2, __m256 q3) {
    __m256 s = _mm256_mul_ps(_mm256_loadu_ps(xr), q0);
    s = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), q1, s);
    s = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), q2, s);
    return _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), q3, s);
}

#define ROWS 4 /* rows of x kept in registers per pass over a weight row */

void q4_linear_f32(const float *x, const uint8_t *qw, const uint16_t *d, const uint16_t *mn, float *out,
                   int64_t M, int64_t K, int64_t N) {
    const int64_t nb = K / 32;
    float *xsum = malloc(sizeof(float) * (size_t)(M * nb)); /* sum of x over each block, for the m term */
    for (int64_t i = 0; i < M; i++)
        for (int64_t b = 0; b < nb; b++) {
            __m256 s = _mm256_loadu_ps(x + i * K + b * 32);
            s = _mm256_add_ps(s, _mm256_loadu_ps(x + i * K + b * 32 + 8));
            s = _mm256_add_ps(s, _mm256_loadu_ps(x + i * K + b * 32 + 16));
            s = _mm256_add_ps(s, _mm256_loadu_ps(x + i * K + b * 32 + 24));
            xsum[i * nb + b] = hsum256(s);
        }
    const __m128i low4 = _mm_set1_epi8(0x0F);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *row = qw + n * nb * 16;
        const uint16_t *dn = d + n * nb, *mnn = mn + n * nb;
        for (int64_t i0 = 0; i0 < M; i0 += ROWS) {
            const int64_t rows = M - i0 < ROWS ? M - i0 : ROWS;
            __m256 acc[ROWS];
            float macc[ROWS];
            for (int r = 0; r < ROWS; r++) {
                acc[r] = _mm256_setzero_ps();
                macc[r] = 0.0f;
            }
            for (int64_t b = 0; b < nb; b++) {
                __m128i bytes = _mm_loadu_si128((const __m128i *)(row + b * 16));
                __m128i lo = _mm_and_si128(bytes, low4);
                __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
                __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
                __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
                __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
                __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
                __m256 db = _mm256_set1_ps(_cvtsh_ss(dn[b]));
                const float mb = _cvtsh_ss(mnn[b]);
                for (int64_t r = 0; r < rows; r++) {
                    acc[r] = _mm256_fmadd_ps(db, dot32(x + (i0 + r) * K + b * 32, q0, q1, q2, q3), acc[r]);
                    macc[r] += mb * xsum[(i0 + r) * nb + b];
                }
            }
            for (int64_t r = 0; r < rows; r++)
                out[(i0 + r) * N + n] = hsum256(acc[r]) + macc[r];
        }
    }
    free(xsum);
}

/* The same for 8-bit blocks: w = d * q with q in -127..127 and d float16, 34 bytes per block of 32
 * weights (the layout of a GGUF Q8_0 tensor, which round-trips exactly). */
void q8_linear_f32(const float *x, const int8_t *qw, const uint16_t *d, float *out, int64_t M, int64_t K,
                   int64_t N) {
    const int64_t nb = K / 32;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t *row = qw + n * K;
        const uint16_t *dn = d + n * nb;
        for (int64_t i0 = 0; i0 < M; i0 += ROWS) {
            const int64_t rows = M - i0 < ROWS ? M - i0 : ROWS;
            __m256 acc[ROWS];
            for (int r = 0; r < ROWS; r++)
                acc[r] = _mm256_setzero_ps();
            for (int64_t b = 0; b < nb; b++) {
                __m128i lo = _mm_loadu_si128((const __m128i *)(row + b * 32));
                __m128i hi = _mm_loadu_si128((const __m128i *)(row + b * 32 + 16));
                __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
                __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
                __m256 q2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
                __m256 q3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
                __m256 db = _mm256_set1_ps(_cvtsh_ss(dn[b]));
                for (int64_t r = 0; r < rows; r++) {
                    acc[r] = _mm256_fmadd_ps(db, dot32(x + (i0 + r) * K + b * 32, q0, q1, q2, q3), acc[r]);
                }
            }
            for (int64_t r = 0; r < rows; r++)
                out[(i0 + r) * N + n] = hsum256(acc[r]);
        }
    }
}

/* RMSNorm in one call, out = x / sqrt(mean(x^2) + eps) * w: PyTorch's composite op costs ~40 us of
 * dispatch for a few rows of 576 numbers and is 17x slower than this loop at 2048 rows. */
void rms_norm_f32(const float *x, const float *w, float *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        __m256 acc = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum256(acc);
        for (; i < dim; i++)
            ss += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        const __m256 s = _mm256_set1_ps(inv);
        for (i = 0; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), s), _mm256_loadu_ps(w + i)));
        for (; i < dim; i++)
            o[i] = xr[i] * inv * w[i];
    }
}

/* Steps with more rows (a decode batch of 6 to ~128 requests): each thread dequantizes a group of
 * weight rows into float32 once (it stays in L2), then multiplies x against it in tiles of 16 rows of x
 * (two vectors of x transposed, so that a vector holds 8 rows at one k) by 6 weight rows (broadcast):
 * 12 accumulators, and per k 2 loads, 6 broadcasts and 12 FMAs, so the loop is bound by FMAs rather than
 * loads. Weights stream from memory as blocks (4-5x fewer bytes than float32), which matters once a
 * step no longer fits the cache. */
#define TILE_COLS 6 /* weight rows per tile (tile16x6) */
#define NG 24       /* weight rows dequantized per group */
#ifndef KC
#define KC 192      /* the slice of K one pass of tiles covers */
#endif

static void dequant_q4_rows(const uint8_t *qw, const uint16_t *d, const uint16_t *mn, int64_t n0, int64_t rows,
                            int64_t K, float *buf) {
    const int64_t nb = K / 32;
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t j = 0; j < rows; j++) {
        const uint8_t *row = qw + (n0 + j) * nb * 16;
        for (int64_t b = 0; b < nb; b++) {
            __m128i bytes = _mm_loadu_si128((const __m128i *)(row + b * 16));
            __m128i lo = _mm_and_si128(bytes, low4);
            __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
            const __m256 db = _mm256_set1_ps(_cvtsh_ss(d[(n0 + j) * nb + b]));
            const __m256 mb = _mm256_set1_ps(_cvtsh_ss(mn[(n0 + j) * nb + b]));
            float *o = buf + j * K + b * 32;
            _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), db, mb));
            _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), db, mb));
            _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), db, mb));
            _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), db, mb));
        }
    }
}

static void dequant_q8_rows(const int8_t *qw, const uint16_t *d, int64_t n0, int64_t rows, int64_t K, float *buf) {
    const int64_t nb = K / 32;
    for (int64_t j = 0; j < rows; j++) {
        const int8_t *row = qw + (n0 + j) * K;
        for (int64_t b = 0; b < nb; b++) {
            const __m256 db = _mm256_set1_ps(_cvtsh_ss(d[(n0 + j) * nb + b]));
            float *o = buf + j * K + b * 32;
            for (int c = 0; c < 4; c++) {
                __m128i q = _mm_loadl_epi64((const __m128i *)(row + b * 32 + c * 8));
                _mm256_storeu_ps(o + c * 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), db));
            }
        }
    }
}

/* acc (6, 16) += a (kc, 16) times 6 float32 weight rows w (rows K apart, kc long): one 16 x 6 tile
 * of the output over a slice of K; the 12 accumulators are named so that they stay in registers. */
static void tile16x6(const float *a, const float *w, int64_t K, int64_t kc, float *acc) {
    __m256 c00 = _mm256_loadu_ps(acc), c01 = _mm256_loadu_ps(acc + 16), c02 = _mm256_loadu_ps(acc + 32);
    __m256 c03 = _mm256_loadu_ps(acc + 48), c04 = _mm256_loadu_ps(acc + 64), c05 = _mm256_loadu_ps(acc + 80);
    __m256 c10 = _mm256_loadu_ps(acc + 8), c11 = _mm256_loadu_ps(acc + 24), c12 = _mm256_loadu_ps(acc + 40);
    __m256 c13 = _mm256_loadu_ps(acc + 56), c14 = _mm256_loadu_ps(acc + 72), c15 = _mm256_loadu_ps(acc + 88);
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K, *w4 = w + 4 * K, *w5 = w + 5 * K;
    for (int64_t k = 0; k < kc; k++, a += 16) {
        const __m256 a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8);
        __m256 b = _mm256_broadcast_ss(w0 + k);
        c00 = _mm256_fmadd_ps(a0, b, c00); c10 = _mm256_fmadd_ps(a1, b, c10);
        b = _mm256_broadcast_ss(w1 + k);
        c01 = _mm256_fmadd_ps(a0, b, c01); c11 = _mm256_fmadd_ps(a1, b, c11);
        b = _mm256_broadcast_ss(w2 + k);
        c02 = _mm256_fmadd_ps(a0, b, c02); c12 = _mm256_fmadd_ps(a1, b, c12);
        b = _mm256_broadcast_ss(w3 + k);
        c03 = _mm256_fmadd_ps(a0, b, c03); c13 = _mm256_fmadd_ps(a1, b, c13);
        b = _mm256_broadcast_ss(w4 + k);
        c04 = _mm256_fmadd_ps(a0, b, c04); c14 = _mm256_fmadd_ps(a1, b, c14);
        b = _mm256_broadcast_ss(w5 + k);
        c05 = _mm256_fmadd_ps(a0, b, c05); c15 = _mm256_fmadd_ps(a1, b, c15);
    }
    _mm256_storeu_ps(acc, c00); _mm256_storeu_ps(acc + 16, c01); _mm256_storeu_ps(acc + 32, c02);
    _mm256_storeu_ps(acc + 48, c03); _mm256_storeu_ps(acc + 64, c04); _mm256_storeu_ps(acc + 80, c05);
    _mm256_storeu_ps(acc + 8, c10); _mm256_storeu_ps(acc + 24, c11); _mm256_storeu_ps(acc + 40, c12);
    _mm256_storeu_ps(acc + 56, c13); _mm256_storeu_ps(acc + 72, c14); _mm256_storeu_ps(acc + 88, c15);
}

/* acc (16) += a (kc, 16) times one weight row: the columns left over when N is not a multiple of 6. */
static void tile16x1(const float *a, const float *w, int64_t kc, float *acc) {
    __m256 c0 = _mm256_loadu_ps(acc), c1 = _mm256_loadu_ps(acc + 8);
    for (int64_t k = 0; k < kc; k++, a += 16) {
        const __m256 b = _mm256_broadcast_ss(w + k);
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(a), b, c0);
        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + 8), b, c1);
    }
    _mm256_storeu_ps(acc, c0);
    _mm256_storeu_ps(acc + 8, c1);
}

/* acc (12, 16) += a (kc, first 8 of 16 rows) times 12 weight rows: a panel with at most 8 rows left
 * (12 accumulators of 8 rows, per k 1 load, 12 broadcasts and 12 FMAs), so a step of M = 16p + r rows
 * with r <= 8 does not pay for 16. Each output's sum runs over k in the same order as in tile16x6. */
static void tile8x12(const float *a, const float *w, int64_t K, int64_t kc, float *acc) {
    __m256 c[12];
    for (int j = 0; j < 12; j++) c[j] = _mm256_loadu_ps(acc + j * 16);
    for (int64_t k = 0; k < kc; k++, a += 16) {
        const __m256 a0 = _mm256_loadu_ps(a);
        for (int j = 0; j < 12; j++) c[j] = _mm256_fmadd_ps(a0, _mm256_broadcast_ss(w + j * K + k), c[j]);
    }
    for (int j = 0; j < 12; j++) _mm256_storeu_ps(acc + j * 16, c[j]);
}

static void tile8x1(const float *a, const float *w, int64_t kc, float *acc) {
    __m256 c0 = _mm256_loadu_ps(acc);
    for (int64_t k = 0; k < kc; k++, a += 16) c0 = _mm256_fmadd_ps(_mm256_loadu_ps(a), _mm256_broadcast_ss(w + k), c0);
    _mm256_storeu_ps(acc, c0);
}

/* y (M, N) = x (M, K) W^T with W as 4-bit blocks (mn != NULL) or 8-bit blocks (mn == NULL). */
void block_gemm_f32(const float *x, const void *qw, const uint16_t *d, const uint16_t *mn, float *out, int64_t M,
                    int64_t K, int64_t N) {
    const int64_t Mp = (M + 15) / 16 * 16, panels = Mp / 16;
    /* x transposed in panels of 16 rows, each (K, 16) and contiguous, rows past M zero */
    float *xT = calloc((size_t)(K * Mp), sizeof(float));
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) xT[(i / 16) * K * 16 + k * 16 + i % 16] = x[i * K + k];
    const int64_t groups = (N + NG - 1) / NG;
#pragma omp parallel
    {
        float *buf = malloc(sizeof(float) * (size_t)(NG * K));
        float *acc = malloc(sizeof(float) * (size_t)(panels * NG * 16)); /* (panel, column, 16 rows) */
#pragma omp for schedule(dynamic, 4)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * NG, rows = N - n0 < NG ? N - n0 : NG;
            if (mn) dequant_q4_rows(qw, d, mn, n0, rows, K, buf);
            else dequant_q8_rows(qw, d, n0, rows, K, buf);
            memset(acc, 0, sizeof(float) * (size_t)(panels * NG * 16));
            /* Slices of K small enough that a panel's slice and 6 weight rows' slices stay in L1. */
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kc = K - k0 < KC ? K - k0 : KC;
                for (int64_t p = 0; p < panels; p++) {
                    const float *a = xT + p * K * 16 + k0 * 16;
                    float *ap = acc + p * NG * 16;
                    int64_t j = 0;
                    if (M - p * 16 <= 8) {
                        for (; j + 12 <= rows; j += 12) tile8x12(a, buf + j * K + k0, K, kc, ap + j * 16);
                        for (; j < rows; j++) tile8x1(a, buf + j * K + k0, kc, ap + j * 16);
                        continue;
                    }
                    for (; j + TILE_COLS <= rows; j += TILE_COLS) tile16x6(a, buf + j * K + k0, K, kc, ap + j * 16);
                    for (; j < rows; j++) tile16x1(a, buf + j * K + k0, kc, ap + j * 16);
                }
            }
            for (int64_t i = 0; i < M; i++)
                for (int64_t j = 0; j < rows; j++) out[i * N + n0 + j] = acc[((i / 16) * NG + j) * 16 + i % 16];
        }
        free(buf);
        free(acc);
    }
    free(xT);
}
