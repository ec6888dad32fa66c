/* y = x W^T with x quantized to 8 bits per block of 32 and W in any block type of quant_blocks.h, as
 * llama.cpp runs its quantized models: integer dot products (vpmaddubsw, vpmaddwd) of the weights' codes
 * with x's replace dequantization and float multiplies. Lossy: each product carries ~0.5% relative error.
 * Each output is computed by the same operations in the same order whatever the number of rows and
 * whichever kernel (streaming or GEMM) runs, so a row's result does not depend on its batch. */
/* No fused a * b + c or reordered sums that one kernel would get and the other not (the build allows both). */
#pragma GCC optimize("fp-contract=off", "no-associative-math")
#include "simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "quant_blocks.h"
#include "quantized_rows.h"
#include "vec_math.h"

#define TC 2   /* weight rows per tile */
#define NGI 24 /* weight rows unpacked per group: a multiple of TC and of 8 */

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int32_t hsum_epi32(__m256i t) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}

/* x (M, K) into xq (quantized_rows.h): each row's scale dx from its largest |x|, then per group of
 * `group` blocks (1, or K_GROUP_BLOCKS for the K types) the smallest integer scale s that keeps
 * |q| <= 127. */
static void quantize_rows(const float *x, int64_t M, int64_t Mp, int64_t K, int64_t group, QuantizedRows *o) {
    const int64_t nb = K / 32;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    float *amax = malloc(sizeof(float) * (size_t)nb);
    for (int64_t i = 0; i < Mp; i++) {
        const int64_t p = i / TR, r = i % TR;
        const float *xr = x + i * K;
        float rmax = 0.0f;
        for (int64_t b = 0; i < M && b < nb; b++) {
            __m256 m = _mm256_setzero_ps();
            for (int c = 0; c < 4; c++) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + b * 32 + c * 8)));
            amax[b] = hmax8(m);
            rmax = amax[b] > rmax ? amax[b] : rmax;
        }
        for (int64_t b0 = 0; i < M && group > 1 && b0 < nb; b0 += group) {
            float g = 0.0f;
            for (int64_t b = b0; b < b0 + group; b++) g = amax[b] > g ? amax[b] : g;
            for (int64_t b = b0; b < b0 + group; b++) amax[b] = g;
        }
        const float dx = rmax / (127.0f * 32767.0f);
        o->dx[i] = dx;
        for (int64_t b = 0; b < nb; b++) {
            int8_t *q = o->q + ((p * nb + b) * TR + r) * 32;
            int16_t *sv = o->s + ((p * nb + b) * TR + r) * 16;
            int s = 1;
            if (i < M && rmax > 0.0f) {
                s = (int)ceilf(amax[b] / (127.0f * dx));
                s = s < 1 ? 1 : (s > 32767 ? 32767 : s);
            }
            for (int c = 0; c < 16; c++) sv[c] = (int16_t)s;
            if (i >= M || rmax == 0.0f) {
                memset(q, 0, 32);
                o->sum[i * nb + b] = o->ssum[i * nb + b] = 0.0f;
                o->qsum16[(i * nb + b) * 2] = o->qsum16[(i * nb + b) * 2 + 1] = 0.0f;
                continue;
            }
            const __m256 inv = _mm256_set1_ps(1.0f / ((float)s * dx));
            __m256i w[4];
            for (int c = 0; c < 4; c++)
                w[c] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + b * 32 + c * 8), inv)); /* nearest */
            const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
            _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, order));
            /* The minimum term takes the quantized block's sum: the result is then exactly the product
             * with the quantized x, and its error does not grow with the blocks' offsets m. */
            const int32_t lo = hsum_epi32(_mm256_add_epi32(w[0], w[1])), hi = hsum_epi32(_mm256_add_epi32(w[2], w[3]));
            o->qsum16[(i * nb + b) * 2] = (float)lo;
            o->qsum16[(i * nb + b) * 2 + 1] = (float)hi;
            o->ssum[i * nb + b] = (float)(lo + hi) * (float)s;
            o->sum[i * nb + b] = o->ssum[i * nb + b] * dx;
        }
    }
    free(amax);
}

/* One group's weight rows ready for the tiles: codes as bytes [row][block][32], each block's two scales
 * [row][block][8] (lanes 0-3: weights 0..15, lanes 4-7: 16..31, the lanes of vpmaddwd's sums), and the
 * blocks' minimums transposed [block][NGI] (zero past the group's last row and for signed types). */
NS_ALWAYS_INLINE void unpack_group(int t, const BlockWeight *w, int64_t n0, int64_t cols, int64_t nb, uint8_t *wu,
                                   float *dv, float *mt) {
    memset(mt, 0, sizeof(float) * (size_t)(nb * NGI));
    for (int64_t j = 0; j < cols; j++) {
        const uint8_t *row = (const uint8_t *)w->data + (n0 + j) * w->row_bytes;
        for (int64_t b = 0; b < nb; b++) {
            const Sub32 s = decode32(t, row, b);
            _mm256_store_si256((__m256i *)(wu + (j * nb + b) * 32), s.q);
            _mm256_store_ps(dv + (j * nb + b) * 8, _mm256_set_m128(_mm_set1_ps(s.s1), _mm_set1_ps(s.s0)));
            mt[b * NGI + j] = s.m;
        }
    }
}

/* The integer part of TR rows times `tc` (TC or 1) weight rows: acc[r][c] += d * s * (q_w . q_x) per block.
 * The empty asm statements keep the scales in registers; the compiler otherwise re-reads them from
 * memory for every product and the loop becomes bound by loads. */
#define TILE_BODY(tc)                                                                                       \
    for (int64_t b = 0; b < nb; b++) {                                                                      \
        __m256i wv[tc], wa[tc];                                                                             \
        __m256 dd[tc];                                                                                      \
        for (int c = 0; c < tc; c++) {                                                                      \
            wv[c] = _mm256_load_si256((const __m256i *)(wu + ((j + c) * nb + b) * 32));                     \
            wa[c] = TYPE_SIGNED(t) ? _mm256_abs_epi8(wv[c]) : wv[c];                                        \
            dd[c] = _mm256_load_ps(dv + ((j + c) * nb + b) * 8);                                            \
            NS_KEEP_IN_REGISTER(dd[c]);                                                                     \
            NS_KEEP_IN_REGISTER(wv[c]);                                                                     \
            if (TYPE_SIGNED(t)) NS_KEEP_IN_REGISTER(wa[c]);                                                 \
        }                                                                                                   \
        for (int r = 0; r < TR; r++) {                                                                      \
            const __m256i xv = _mm256_load_si256((const __m256i *)(qp + (b * TR + r) * 32));                \
            __m256i sv = _mm256_load_si256((const __m256i *)(sp + (b * TR + r) * 16));                      \
            NS_KEEP_IN_REGISTER(sv);                                                                        \
            for (int c = 0; c < tc; c++) {                                                                  \
                const __m256i p = dot_codes(t, wv[c], wa[c], xv, sv);                                       \
                acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dd[c], acc[r][c]);                       \
            }                                                                                               \
        }                                                                                                   \
    }

/* One group of weight rows (n0 .. n0 + cols - 1) against rows i0 .. i0 + M - 1 of x: unpack, minimum
 * terms, then the tiles. The scratch (wu, dv, mt, m_terms) is the calling thread's. */
NS_ALWAYS_INLINE void gemm_group(int t, const QuantizedRows *xq, const BlockWeight *w, float *out, int64_t ldo,
                                 int64_t i0, int64_t M, int64_t nb, int64_t n0, int64_t cols, uint8_t *wu, float *dv,
                                 float *mt, float *m_terms) {
    const int64_t panels = (M + TR - 1) / TR;
    unpack_group(t, w, n0, cols, nb, wu, dv, mt);
    /* the minimum term of every output, each lane one weight row, in block order (as stream_row) */
    for (int64_t i = 0; i < M; i++) {
        __m256 a[NGI / 8];
        for (int v = 0; v < NGI / 8; v++) a[v] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const __m256 s = _mm256_set1_ps(xq->sum[(i0 + i) * nb + b]);
            for (int v = 0; v < NGI / 8; v++) a[v] = _mm256_fmadd_ps(s, _mm256_loadu_ps(mt + b * NGI + v * 8), a[v]);
        }
        for (int v = 0; v < NGI / 8; v++) _mm256_storeu_ps(m_terms + i * NGI + v * 8, a[v]);
    }
    for (int64_t p = 0; p < panels; p++) {
        const int8_t *qp = xq->q + (i0 / TR + p) * nb * TR * 32;
        const int16_t *sp = xq->s + (i0 / TR + p) * nb * TR * 16;
        const int64_t rows = M - p * TR < TR ? M - p * TR : TR;
        int64_t j = 0;
        for (; j + TC <= cols; j += TC) {
            __m256 acc[TR][TC];
            for (int r = 0; r < TR; r++) for (int c = 0; c < TC; c++) acc[r][c] = _mm256_setzero_ps();
            TILE_BODY(TC)
            for (int64_t r = 0; r < rows; r++)
                for (int c = 0; c < TC; c++) {
                    const int64_t i = p * TR + r;
                    out[(i0 + i) * ldo + n0 + j + c] = finish(xq->dx[i0 + i], acc[r][c], m_terms[i * NGI + j + c]);
                }
        }
        for (; j < cols; j++) {
            __m256 acc[TR][1];
            for (int r = 0; r < TR; r++) acc[r][0] = _mm256_setzero_ps();
            TILE_BODY(1)
            for (int64_t r = 0; r < rows; r++) {
                const int64_t i = p * TR + r;
                out[(i0 + i) * ldo + n0 + j] = finish(xq->dx[i0 + i], acc[r][0], m_terms[i * NGI + j]);
            }
        }
    }
}

/* Rows i0 .. i0 + M - 1 (i0 a multiple of TR) through the tiles, groups of weight rows in parallel.
 * NOTE: the type is dispatched inside the parallel region, per group, so that each gemm_group call has
 * a literal type: GCC outlines OpenMP regions before it inlines, and a type passed into a region is a
 * run-time value there (every decode32 would branch on it). */
static void gemm_rows(const QuantizedRows *xq, const BlockWeight *w, float *out, int64_t ldo, int64_t i0, int64_t M,
                      int64_t nb, int64_t N) {
    const int64_t groups = (N + NGI - 1) / NGI;
#pragma omp parallel
    {
        uint8_t *wu = aligned_alloc(32, (size_t)(NGI * nb * 32));
        float *dv = aligned_alloc(32, sizeof(float) * (size_t)(NGI * nb * 8));
        float *mt = malloc(sizeof(float) * (size_t)(nb * NGI));
        float *m_terms = malloc(sizeof(float) * (size_t)(M * NGI)); /* [row][col] */
#pragma omp for schedule(dynamic, 2)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * NGI, cols = N - n0 < NGI ? N - n0 : NGI;
            switch (w->type) {
#define CASE(T) case T: gemm_group(T, xq, w, out, ldo, i0, M, nb, n0, cols, wu, dv, mt, m_terms); break;
                FOR_EACH_BLOCK32_TYPE(CASE)
#undef CASE
            default: break;
            }
        }
        free(wu);
        free(dv);
        free(mt);
        free(m_terms);
    }
}

/* Up to STREAM_MAX_ROWS rows: each weight row's blocks are read once from memory and used for every row
 * of x (the step is bound by reading the weights), with the GEMM's operations in the GEMM's order. */
NS_ALWAYS_INLINE void stream_row(int t, const QuantizedRows *xq, const uint8_t *row, float *out, int64_t ldo,
                                 int64_t M, int64_t nb) {
    __m256 acc[STREAM_MAX_ROWS];
    float m_term[STREAM_MAX_ROWS];
    for (int64_t i = 0; i < M; i++) {
        acc[i] = _mm256_setzero_ps();
        m_term[i] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        _mm_prefetch((const char *)row + b * type_block_bytes(t) + STREAM_PREFETCH_BYTES, _MM_HINT_T0);
        const Sub32 s = decode32(t, row, b);
        const __m256i wa = TYPE_SIGNED(t) ? _mm256_abs_epi8(s.q) : s.q;
        const __m256 dd = _mm256_set_m128(_mm_set1_ps(s.s1), _mm_set1_ps(s.s0));
        for (int64_t i = 0; i < M; i++) {
            const int64_t off = quantized_row_offset(i, nb) + b * TR;
            const __m256i xv = _mm256_load_si256((const __m256i *)(xq->q + off * 32));
            const __m256i sv = _mm256_load_si256((const __m256i *)(xq->s + off * 16));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_codes(t, s.q, wa, xv, sv)), dd, acc[i]);
            /* the GEMM's minimum term: the same fused multiply-adds in block order */
            if (!TYPE_SIGNED(t)) m_term[i] = NS_FMA(xq->sum[i * nb + b], s.m, m_term[i]);
        }
    }
    for (int64_t i = 0; i < M; i++) out[i * ldo] = finish(xq->dx[i], acc[i], m_term[i]);
}

/* Each weight row in parallel (STREAM_ROWS_CASE). */
static void stream_rows(const QuantizedRows *xq, const BlockWeight *w, float *out, int64_t ldo, int64_t M, int64_t nb) {
    const uint8_t *data = (const uint8_t *)w->data;
    const int64_t N = w->n, rb = w->row_bytes;
    switch (w->type) {
#define CASE(T) STREAM_ROWS_CASE(T, stream_row)
        FOR_EACH_BLOCK32_TYPE(CASE)
#undef CASE
    default: break;
    }
}

/* Rows of x per pass of the GEMM over the weights: the quantized panel slice stays in L2, and each
 * pass unpacks the weights again (~2% of the work at 64 rows). */
#define CHUNK_ROWS 64

/* out (M, columns of w, row stride ldo) = x (M, K) W^T, W of a block type, x quantized per block of 32:
 * few rows stream the weight blocks (bound by memory), more rows go through the tiled GEMM; the K types
 * through k_quant_i8.c's kernels, with x's scale one per super-block. */
void weight_gemm_i8(const float *x, const BlockWeight *w, float *out, int64_t M, int64_t ldo) {
    const int64_t K = w->k, nb = K / 32, Mp = (M + TR - 1) / TR * TR;
    QuantizedRows xq = {aligned_alloc(32, (size_t)(Mp * K)), aligned_alloc(32, sizeof(int16_t) * (size_t)(Mp * nb * 16)),
                        malloc(sizeof(float) * (size_t)Mp), malloc(sizeof(float) * (size_t)(Mp * nb)),
                        malloc(sizeof(float) * (size_t)(Mp * nb)), malloc(sizeof(float) * (size_t)(Mp * nb * 2))};
    const int k_type = TYPE_IS_K(w->type);
    quantize_rows(x, M, Mp, K, k_type ? K_GROUP_BLOCKS : 1, &xq);
    if (!k_type && M <= STREAM_MAX_ROWS) stream_rows(&xq, w, out, ldo, M, nb);
    else /* k_gemm_i8 streams a chunk of up to STREAM_MAX_ROWS rows itself */
        for (int64_t i0 = 0; i0 < M; i0 += CHUNK_ROWS) {
            const int64_t rows = M - i0 < CHUNK_ROWS ? M - i0 : CHUNK_ROWS;
            if (k_type) k_gemm_i8(&xq, w, out, ldo, i0, rows);
            else gemm_rows(&xq, w, out, ldo, i0, rows, nb, w->n);
        }
    free(xq.q);
    free(xq.s);
    free(xq.dx);
    free(xq.sum);
    free(xq.ssum);
    free(xq.qsum16);
}
