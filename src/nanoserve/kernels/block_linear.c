/* y = x W^T with W stored in blocks of 4-bit or 8-bit integers: a streaming kernel for small batches
 * and a small GEMM for decode batches of up to ~64 rows (block_gemm_f32, below).
 * 4-bit: each row of W is cut into blocks of 32
 * weights, each block holds w = d * q + m with q in 0..15 (16 bytes of nibbles: byte j has weight j in
 * its low nibble and weight j + 16 in its high nibble), d and m float16 (as in a GGUF Q4_1 block). A
 * row then streams 20 bytes per 32 weights instead of 128, which bounds a decode step with few rows. */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

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

/* Steps with more rows (a decode batch of 16 to ~128 requests): each thread dequantizes a group of
 * weight rows into float32 once (it stays in L2), then multiplies x against it in tiles of 16 rows of x
 * (two vectors of x transposed, so that a vector holds 8 rows at one k) by 6 weight rows (broadcast):
 * 12 accumulators, and per k 2 loads, 6 broadcasts and 12 FMAs, so the loop is bound by FMAs rather than
 * loads. Weights stream from memory as blocks (4-5x fewer bytes than float32), which matters once a
 * step no longer fits the cache. */
#define TILE_COLS 6 /* weight rows per tile (tile16x6) */
#define NG 24       /* weight rows dequantized per group */

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

static inline void store_tile_vec(__m256 acc, float *out, int64_t i0, int64_t n, int64_t M, int64_t N) {
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8 && i0 + l < M; l++) out[(i0 + l) * N + n] = lanes[l];
}

/* out[i0 .. i0 + 16, n .. n + 6] (rows below M) from xT (K, Mp) and 6 float32 weight rows w (6, K);
 * the 12 accumulators are named so that they stay in registers. */
static void tile16x6(const float *xT, int64_t Mp, int64_t i0, const float *w, int64_t K, float *out, int64_t n,
                     int64_t M, int64_t N) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00, c04 = c00, c05 = c00;
    __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00, c14 = c00, c15 = c00;
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K, *w4 = w + 4 * K, *w5 = w + 5 * K;
    for (int64_t k = 0; k < K; k++) {
        const __m256 a0 = _mm256_loadu_ps(xT + k * Mp + i0), a1 = _mm256_loadu_ps(xT + k * Mp + i0 + 8);
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
    const __m256 top[6] = {c00, c01, c02, c03, c04, c05}, bottom[6] = {c10, c11, c12, c13, c14, c15};
    for (int c = 0; c < 6; c++) {
        store_tile_vec(top[c], out, i0, n + c, M, N);
        store_tile_vec(bottom[c], out, i0 + 8, n + c, M, N);
    }
}

/* The edges: 8 rows of x (one vector) by one weight row. */
static void tile8x1(const float *xT, int64_t Mp, int64_t i0, const float *w, int64_t K, float *out, int64_t n,
                    int64_t M, int64_t N) {
    __m256 c0 = _mm256_setzero_ps(), c1 = c0;
    int64_t k = 0;
    for (; k + 2 <= K; k += 2) {
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(xT + k * Mp + i0), _mm256_broadcast_ss(w + k), c0);
        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(xT + (k + 1) * Mp + i0), _mm256_broadcast_ss(w + k + 1), c1);
    }
    for (; k < K; k++) c0 = _mm256_fmadd_ps(_mm256_loadu_ps(xT + k * Mp + i0), _mm256_broadcast_ss(w + k), c0);
    store_tile_vec(_mm256_add_ps(c0, c1), out, i0, n, M, N);
}

/* y (M, N) = x (M, K) W^T with W as 4-bit blocks (mn != NULL) or 8-bit blocks (mn == NULL). */
void block_gemm_f32(const float *x, const void *qw, const uint16_t *d, const uint16_t *mn, float *out, int64_t M,
                    int64_t K, int64_t N) {
    const int64_t Mp = (M + 15) / 16 * 16;
    float *xT = calloc((size_t)(K * Mp), sizeof(float)); /* x transposed, rows padded with zeros */
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) xT[k * Mp + i] = x[i * K + k];
    const int64_t groups = (N + NG - 1) / NG;
#pragma omp parallel
    {
        float *buf = malloc(sizeof(float) * (size_t)(NG * K));
#pragma omp for schedule(dynamic, 4)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * NG, rows = N - n0 < NG ? N - n0 : NG;
            if (mn) dequant_q4_rows(qw, d, mn, n0, rows, K, buf);
            else dequant_q8_rows(qw, d, n0, rows, K, buf);
            for (int64_t i0 = 0; i0 < Mp; i0 += 16) {
                int64_t j = 0;
                for (; j + TILE_COLS <= rows; j += TILE_COLS) tile16x6(xT, Mp, i0, buf + j * K, K, out, n0 + j, M, N);
                for (; j < rows; j++)
                    for (int64_t i = i0; i < i0 + 16 && i < M; i += 8)
                        tile8x1(xT, Mp, i, buf + j * K, K, out, n0 + j, M, N);
            }
        }
        free(buf);
    }
    free(xT);
}
