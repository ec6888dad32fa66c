/* y = x W^T on float32 activations, for W of every type quant_blocks.h reads (block types and float32 /
 * float16 / bfloat16), straight from the file's layout. Few rows (a decode step) stream each weight
 * row once from memory and use it for every row of x, which bounds the step by the bytes of the
 * weights; more rows (block_gemm_f32, below) dequantize a group of weight rows into float32 once (it
 * stays in L2) and multiply x against it in register tiles. */
#include "simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "quant_blocks.h"
#include "vec_math.h"

#define ROWS 4 /* rows of x kept in registers per pass over a weight row */

/* The 8 partial sums of 16 activations times 16 weights (as 2 vectors of 8 floats). */
NS_ALWAYS_INLINE __m256 dot16(const float *xr, __m256 q0, __m256 q1) {
    return _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), q1, _mm256_mul_ps(_mm256_loadu_ps(xr), q0));
}

/* The 32 codes of a Sub32 as 4 vectors of 8 floats. */
NS_ALWAYS_INLINE void codes_to_float(int t, __m256i q, __m256 *f) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    if (TYPE_SIGNED(t)) {
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
        f[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
        f[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
    } else {
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
        f[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
        f[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
    }
}

/* Streaming, one weight row of a block type against M rows of x: per block,
 * sum_j w_j x_j = s0 (q . x)[0:16] + s1 (q . x)[16:32] + m sum(x). */
NS_ALWAYS_INLINE void stream_block_row(int t, const float *x, const uint8_t *row, float *out, int64_t M, int64_t K,
                                       int64_t ldo, const float *xsum) {
    const int64_t nb = K / 32;
    for (int64_t i0 = 0; i0 < M; i0 += ROWS) {
        const int64_t rows = M - i0 < ROWS ? M - i0 : ROWS;
        __m256 acc[ROWS];
        float macc[ROWS];
        for (int r = 0; r < ROWS; r++) {
            acc[r] = _mm256_setzero_ps();
            macc[r] = 0.0f;
        }
        for (int64_t b = 0; b < nb; b++) {
            _mm_prefetch((const char *)row + b * type_block_bytes(t) + STREAM_PREFETCH_BYTES, _MM_HINT_T0);
            const Sub32 s = decode32(t, row, b);
            __m256 q[4];
            codes_to_float(t, s.q, q);
            const __m256 s0 = _mm256_set1_ps(s.s0), s1 = _mm256_set1_ps(s.s1);
            for (int64_t r = 0; r < rows; r++) {
                const float *xr = x + (i0 + r) * K + b * 32;
                if (TYPE_SCALE_PER_16(t)) {
                    acc[r] = _mm256_fmadd_ps(s0, dot16(xr, q[0], q[1]), acc[r]);
                    acc[r] = _mm256_fmadd_ps(s1, dot16(xr + 16, q[2], q[3]), acc[r]);
                } else {
                    const __m256 d = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), q[3],
                                                     _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), q[2], dot16(xr, q[0], q[1])));
                    acc[r] = _mm256_fmadd_ps(s0, d, acc[r]);
                }
                if (t == T_Q2_K) /* a minimum per 16 weights: xsum holds x's sums per 16 */
                    macc[r] += s.m * xsum[((i0 + r) * nb + b) * 2] + s.m1 * xsum[((i0 + r) * nb + b) * 2 + 1];
                else if (!TYPE_SIGNED(t)) macc[r] += s.m * xsum[(i0 + r) * nb + b];
            }
        }
        for (int64_t r = 0; r < rows; r++) out[(i0 + r) * ldo] = hsum256(acc[r]) + macc[r];
    }
}

/* Streaming, one weight row of a float type against 2 rows of x at a time: 32 weights per step converted
 * to float32, into 4 accumulators per row (one accumulator would wait on its own FMA latency every
 * 8 weights). Every row's sum takes the same order, whatever M is. */
#define FLOAT_ROWS 2
NS_ALWAYS_INLINE void stream_float_row(int t, const float *x, const uint8_t *row, float *out, int64_t M, int64_t K,
                                       int64_t ldo) {
    const int64_t K32 = K / 32 * 32, K8 = K / 8 * 8, elem = t == T_F32 ? 4 : 2;
    for (int64_t i0 = 0; i0 < M; i0 += FLOAT_ROWS) {
        const int64_t rows = M - i0 < FLOAT_ROWS ? M - i0 : FLOAT_ROWS;
        __m256 acc[FLOAT_ROWS][4];
        for (int r = 0; r < FLOAT_ROWS; r++)
            for (int u = 0; u < 4; u++) acc[r][u] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K32; k += 32) {
            /* asked for ahead where the row is read in more than one pass (M > FLOAT_ROWS); in one pass the
             * hardware's prefetch alone was faster (bench kernels F16 65536 x 2048: 1 row 1.25x, 2 rows
             * 1.22x; with 4 and 8 rows 0.67x and 0.83x) */
            if (M > FLOAT_ROWS) {
                _mm_prefetch((const char *)row + k * elem + STREAM_PREFETCH_BYTES, _MM_HINT_T0);
                if (elem == 4) _mm_prefetch((const char *)row + k * 4 + 64 + STREAM_PREFETCH_BYTES, _MM_HINT_T0);
            }
            __m256 wv[4];
            for (int u = 0; u < 4; u++) wv[u] = load8_float_type(t, row, k + 8 * u);
            for (int64_t r = 0; r < rows; r++)
                for (int u = 0; u < 4; u++)
                    acc[r][u] = _mm256_fmadd_ps(wv[u], _mm256_loadu_ps(x + (i0 + r) * K + k + 8 * u), acc[r][u]);
        }
        for (int64_t k = K32; k < K8; k += 8) {
            const __m256 wv = load8_float_type(t, row, k);
            for (int64_t r = 0; r < rows; r++) acc[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (i0 + r) * K + k), acc[r][0]);
        }
        for (int64_t r = 0; r < rows; r++) {
            float tail = 0.0f;
            for (int64_t k = K8; k < K; k++) tail += load1_float_type(t, row, k) * x[(i0 + r) * K + k];
            const __m256 sum = _mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), _mm256_add_ps(acc[r][2], acc[r][3]));
            out[(i0 + r) * ldo] = hsum256(sum) + tail;
        }
    }
}

NS_ALWAYS_INLINE void stream_row(int t, const float *x, const uint8_t *row, float *out, int64_t M, int64_t K, int64_t ldo,
                                 const float *xsum) {
    if (TYPE_IS_FLOAT(t)) stream_float_row(t, x, row, out, M, K, ldo);
    else stream_block_row(t, x, row, out, M, K, ldo, xsum);
}

/* out (M, columns of w, row stride ldo) = x (M, K) W^T, streaming W once: for a few rows. One parallel
 * region per type, so that the type is a literal inside it (GCC outlines OpenMP regions before it
 * inlines; a type passed into a region would be a run-time value there, and every block would branch). */
void weight_stream_f32(const float *x, const BlockWeight *w, float *out, int64_t M, int64_t ldo) {
    const int64_t K = w->k, N = w->n, nb = K / 32, rb = w->row_bytes;
    const uint8_t *data = (const uint8_t *)w->data;
    /* sum of x over each block, for the m term of block types; Q2_K: over each 16 values (its minimums) */
    float *xsum = NULL;
    if (w->type == T_Q2_K) {
        xsum = malloc(sizeof(float) * (size_t)(M * nb * 2));
        for (int64_t i = 0; i < M * nb * 2; i++)
            xsum[i] = hsum256(_mm256_add_ps(_mm256_loadu_ps(x + i * 16), _mm256_loadu_ps(x + i * 16 + 8)));
    } else if (!TYPE_IS_FLOAT(w->type)) {
        xsum = malloc(sizeof(float) * (size_t)(M * nb));
        for (int64_t i = 0; i < M; i++)
            for (int64_t b = 0; b < nb; b++) {
                const float *xb = x + i * K + b * 32;
                __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                         _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
                xsum[i * nb + b] = hsum256(s);
            }
    }
    switch (w->type) {
#define CASE(T)                                                                                              \
    case T:                                                                                                  \
        FOR_EACH_SHARED_ROW(N, rb, n, { stream_row(T, x, data + n * rb, out + n, M, K, ldo, xsum); });         \
        break;
        FOR_EACH_BLOCK_TYPE(CASE) CASE(T_F32) CASE(T_F16) CASE(T_BF16)
#undef CASE
    default: break;
    }
    free(xsum);
}

/* Weight rows n0 .. n0 + rows - 1 as float32 (rows, K) in buf: exactly the values gguf-py dequantizes to. */
NS_ALWAYS_INLINE void dequant_rows_type(int t, const BlockWeight *w, int64_t n0, int64_t rows, float *buf) {
    const int64_t K = w->k;
    for (int64_t j = 0; j < rows; j++) {
        const uint8_t *row = (const uint8_t *)w->data + (n0 + j) * w->row_bytes;
        float *o = buf + j * K;
        if (TYPE_IS_FLOAT(t)) {
            int64_t k = 0;
            for (; k + 8 <= K; k += 8) _mm256_storeu_ps(o + k, load8_float_type(t, row, k));
            for (; k < K; k++) o[k] = load1_float_type(t, row, k);
            continue;
        }
        for (int64_t b = 0; b < K / 32; b++) {
            const Sub32 s = decode32(t, row, b);
            __m256 q[4];
            codes_to_float(t, s.q, q);
            const __m256 s0 = _mm256_set1_ps(s.s0), s1 = _mm256_set1_ps(s.s1);
            const __m256 m0 = _mm256_set1_ps(s.m), m1 = _mm256_set1_ps(s.m1);
            for (int c = 0; c < 4; c++) {
                const __m256 sc = c < 2 ? s0 : s1, m = c < 2 ? m0 : m1;
                /* one rounding of the exact product (plus the minimum), as gguf-py computes it */
                _mm256_storeu_ps(o + b * 32 + c * 8, TYPE_SIGNED(t) ? _mm256_mul_ps(q[c], sc) : _mm256_fmadd_ps(q[c], sc, m));
            }
        }
    }
}

void dequant_rows(const BlockWeight *w, int64_t n0, int64_t rows, float *buf) {
    switch (w->type) {
#define CASE(T) case T: dequant_rows_type(T, w, n0, rows, buf); break;
        FOR_EACH_BLOCK_TYPE(CASE) CASE(T_F32) CASE(T_F16) CASE(T_BF16)
#undef CASE
    default: break;
    }
}

/* Steps with more rows (a decode batch of 6 or more, a prompt): each thread dequantizes a group of
 * weight rows into float32 once (it stays in L2), then multiplies x against it in tiles of 16 rows of x
 * (two vectors of x transposed, so that a vector holds 8 rows at one k) by 6 weight rows (broadcast):
 * 12 accumulators, and per k 2 loads, 6 broadcasts and 12 FMAs, so the loop is bound by FMAs rather than
 * loads. Weights stream from memory in their compact form, which matters once a step no longer fits
 * the cache. */
#define TILE_COLS 6 /* weight rows per tile (tile16x6) */
#define NG 24       /* weight rows dequantized per group */
#ifndef KC
#define KC 192      /* the slice of K one pass of tiles covers */
#endif

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

/* One group's outputs, acc (panel, column, 16 rows) into out (row, column, row stride ldo), columns n0 ..
 * n0 + cols - 1: 8 x 8 blocks transposed in registers (copied one float at a time, the outputs took ~10%
 * of an F16 product of 512 x 1536 x 576). Past row M, acc holds the zero rows of the last panel. */
static void store_group(const float *acc, float *out, int64_t ldo, int64_t M, int64_t n0, int64_t cols) {
    const int64_t full = cols / 8 * 8;
    for (int64_t i0 = 0; i0 < M; i0 += 8) {
        const float *a = acc + (i0 / 16) * NG * 16 + i0 % 16; /* column 0 of rows i0 .. i0 + 7 */
        const int64_t rows = M - i0 < 8 ? M - i0 : 8;
        for (int64_t j0 = 0; j0 < full; j0 += 8) {
            __m256i in[8], t[8];
            for (int c = 0; c < 8; c++) in[c] = _mm256_castps_si256(_mm256_loadu_ps(a + (j0 + c) * 16));
            transpose8x32(in, t);
            for (int64_t i = 0; i < rows; i++) _mm256_storeu_ps(out + (i0 + i) * ldo + n0 + j0, _mm256_castsi256_ps(t[i]));
        }
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = full; j < cols; j++) out[(i0 + i) * ldo + n0 + j] = a[j * 16 + i];
    }
}

/* out (M, columns of w, row stride ldo) = x (M, K) W^T for any number of rows. */
void weight_gemm_f32(const float *x, const BlockWeight *w, float *out, int64_t M, int64_t ldo) {
    const int64_t K = w->k, N = w->n;
    const int64_t Mp = (M + 15) / 16 * 16, panels = Mp / 16;
    /* x transposed in panels of 16 rows, each (K, 16) and contiguous, rows past M zero */
    float *xT = malloc(sizeof(float) * (size_t)(K * Mp));
    const int64_t groups = (N + NG - 1) / NG;
#pragma omp parallel
    {
        /* the panels split between the threads (one thread transposing a prompt of 512 rows left the
         * other idle for ~15% of a product of 576 x 1536) */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < panels; p++) {
            float *dst = xT + p * K * 16;
            const int64_t rows = M - p * 16 < 16 ? M - p * 16 : 16;
            if (rows < 16) memset(dst, 0, sizeof(float) * (size_t)(K * 16));
            int64_t r = 0;
            for (; r + 8 <= rows; r += 8) { /* 8 rows x 8 columns at a time (a scalar copy: 8x the time) */
                const float *src = x + (p * 16 + r) * K;
                int64_t k = 0;
                for (; k + 8 <= K; k += 8) {
                    __m256i in[8], t[8];
                    for (int j = 0; j < 8; j++) in[j] = _mm256_castps_si256(_mm256_loadu_ps(src + j * K + k));
                    transpose8x32(in, t);
                    for (int j = 0; j < 8; j++) _mm256_storeu_ps(dst + (k + j) * 16 + r, _mm256_castsi256_ps(t[j]));
                }
                for (; k < K; k++)
                    for (int j = 0; j < 8; j++) dst[k * 16 + r + j] = src[j * K + k];
            }
            for (; r < rows; r++)
                for (int64_t k = 0; k < K; k++) dst[k * 16 + r] = x[(p * 16 + r) * K + k];
        }
        float *buf = malloc(sizeof(float) * (size_t)(NG * K));
        float *acc = malloc(sizeof(float) * (size_t)(panels * NG * 16)); /* (panel, column, 16 rows) */
#pragma omp for GEMM_SCHEDULE
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * NG, rows = N - n0 < NG ? N - n0 : NG;
            dequant_rows(w, n0, rows, buf);
            memset(acc, 0, sizeof(float) * (size_t)(panels * NG * 16));
            NextGroupPrefetch next = next_group_prefetch(w, n0, rows, NG, panels * ((K + KC - 1) / KC));
            /* Slices of K small enough that a panel's slice and 6 weight rows' slices stay in L1. */
            for (int64_t k0 = 0; k0 < K; k0 += KC) {
                const int64_t kc = K - k0 < KC ? K - k0 : KC;
                for (int64_t p = 0; p < panels; p++, prefetch_slice(&next)) {
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
            store_group(acc, out, ldo, M, n0, rows);
        }
        free(buf);
        free(acc);
    }
    free(xT);
}
