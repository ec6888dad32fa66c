/* y = x W^T with x quantized to 8 bits per block of 32 and W in any block type of quant_blocks.h, as
 * llama.cpp runs its quantized models: integer dot products (vpmaddubsw, vpmaddwd) of the weights' codes
 * with x's replace dequantization and float multiplies. Lossy: each product carries ~0.5% relative error.
 * Each output is computed by the same operations in the same order whatever the number of rows and
 * whichever kernel (streaming or GEMM) runs, so a row's result does not depend on its batch: per block b
 * the exact integer T_b = codes . q, then S_j = the fused multiply-adds T_b * (d_b * s_b) over the blocks
 * b = j mod 8 in order, the eight S_j summed as hsum256 sums lanes, times dx, plus the minimum term. */
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

#define SUB 8  /* weight rows side by side in the GEMM's vectors, one per lane */
#define NGI 24 /* weight rows unpacked per group: a multiple of SUB */

/* Steps (4 weights of each row) whose vpmaddubsw pair sums one int16 lane holds before it is widened to
 * int32: 8 steps of 4-bit codes (16 products, 16 * 15 * 127 < 32767), 4 of 5-bit codes, 1 of 8-bit codes. */
#define WIDEN_STEPS(t) ((t) == T_Q4_0 || (t) == T_Q4_1 ? 8 : (t) == T_Q5_0 || (t) == T_Q5_1 ? 4 : 1)

/* The signed 8-bit types (no minimum term) whose GEMM multiplies int16 codes (vpmaddwd on x's codes
 * widened to int16, QuantizedRows.q16): two multiplies per 32 products where vpsignb, vpmaddubsw and
 * vpmaddwd are three. */
#define GEMM_INT16(t) ((t) == T_Q8_0 || (t) == T_IQ4_NL)
/* Their GEMM runs from 8 rows (bench kernels --types Q8_0 --rows 5,6,7,8 --n 16384, against streaming,
 * alternated 3 times: 0.68x, 0.84x, 0.95x, 1.07x). */
#define GEMM_INT16_STREAM_MAX_ROWS 7

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Rows of x from which quantize_rows splits its rows between the threads (each row is quantized alone,
 * so the result does not depend on the split). Measured: see quantize_rows. */
#define QUANTIZE_PARALLEL_ROWS 32

/* x (M, K) into xq (quantized_rows.h): each row's scale dx from its largest |x|, then per group of
 * `group` blocks (1, or K_GROUP_BLOCKS for the K types) the smallest integer scale s that keeps
 * |q| <= 127 (and q widened to int16 where xq->q16 is allocated, q with each block's halves paired where
 * xq->q_pairs is). Prompt-sized steps split the rows between the threads: one thread quantizing a step of
 * 2048 rows left the other idle for ~2% of an offline c=32-like load. */
static void quantize_rows(const float *x, int64_t M, int64_t Mp, int64_t K, int64_t group, int64_t panel,
                          QuantizedRows *o) {
    const int64_t nb = K / 32, nbx = xs_blocks(nb), ngx = k_xs_groups(nb);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
#pragma omp parallel if (Mp >= QUANTIZE_PARALLEL_ROWS)
    {
        float *amax = malloc(sizeof(float) * (size_t)nb);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < Mp; i++) {
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
            for (int64_t b = nb; b < nbx; b++) o->sx[i * nbx + b] = 0.0f;
            for (int64_t g = group > 1 ? nb / group : ngx; g < ngx; g++) o->xk[i * ngx + g] = 0.0f;
            const int64_t block0 = x_block_index(i, 0, nb, panel); /* block b is b * panel further */
            for (int64_t b = 0; b < nb; b++) {
                const int64_t at = (block0 + b * panel) * 32;
                int8_t *q = o->q + at;
                int s = 1;
                if (i < M && rmax > 0.0f) {
                    s = (int)ceilf(amax[b] / (127.0f * dx));
                    s = s < 1 ? 1 : (s > 32767 ? 32767 : s);
                }
                o->sx[i * nbx + b] = (float)s;
                if (group > 1 && b % group == 0) o->xk[i * ngx + b / group] = dx * (float)s;
                if (i >= M || rmax == 0.0f) {
                    memset(q, 0, 32);
                    if (o->q16) memset(o->q16 + at, 0, 64);
                    if (o->q_pairs) memset(o->q_pairs + at, 0, 32);
                    if (o->sum) {
                        o->sum[i * nb + b] = 0.0f;
                        o->qs16[(i * nb + b) * 2] = o->qs16[(i * nb + b) * 2 + 1] = o->qs32[qs32_index(i, nb, b)] = 0;
                    }
                    continue;
                }
                const __m256 inv = _mm256_set1_ps(1.0f / ((float)s * dx));
                __m256i w[4];
                for (int c = 0; c < 4; c++)
                    w[c] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + b * 32 + c * 8), inv)); /* nearest */
                const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(w[0], w[1]), _mm256_packs_epi32(w[2], w[3]));
                const __m256i codes = _mm256_permutevar8x32_epi32(packed, order);
                _mm256_storeu_si256((__m256i *)q, codes);
                if (o->q16) { /* widened for the GEMM_INT16 types' GEMM */
                    int16_t *q16 = o->q16 + at;
                    _mm256_storeu_si256((__m256i *)q16, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(codes)));
                    _mm256_storeu_si256((__m256i *)(q16 + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(codes, 1)));
                }
                if (o->q_pairs) /* for the K_PAIRED types' GEMM */
                    _mm256_storeu_si256((__m256i *)(o->q_pairs + at), pair_halves(codes));
                if (!o->sum) continue; /* the signed 32-weight types: no minimum term */
                /* The minimum term takes the quantized block's sum: the result is then exactly the product
                 * with the quantized x, and its error does not grow with the blocks' offsets m. */
                const int32_t lo = hsum_epi32(_mm256_add_epi32(w[0], w[1])), hi = hsum_epi32(_mm256_add_epi32(w[2], w[3]));
                o->qs16[(i * nb + b) * 2] = (int16_t)lo; /* |lo| <= 16 * 127 */
                o->qs16[(i * nb + b) * 2 + 1] = (int16_t)hi;
                o->qs32[qs32_index(i, nb, b)] = (int16_t)(lo + hi); /* <= 32 * 127 */
                o->sum[i * nb + b] = (float)(lo + hi) * (float)s * dx;
            }
        }
        free(amax);
    }
}

/* Ask for weight rows first .. first + count - 1 (clipped to the matrix) before unpack_group decodes
 * them, one set of rows ahead (past a group's last set: the rows after it, the next group). Rows are
 * contiguous, and a row of a few hundred bytes ends before the hardware prefetcher follows it. Measured 2026-12-04, offline c=32-like load on SmolLM2 Q4_K_M (mostly
 * Q5_0 rows of 396 bytes): 378-396 -> 445-450 output tok/s, alternated twice; Q8_0 no faster, and the
 * same in the K types' GEMM (the 1.1B file's rows of 1152+ bytes) gave nothing, so it does without. */
static inline void prefetch_rows(const BlockWeight *w, int64_t first, int64_t count) {
    const int64_t rows = w->n - first < count ? w->n - first : count;
    for (int64_t off = 0; off < rows * w->row_bytes; off += 64)
        _mm_prefetch((const char *)w->data + first * w->row_bytes + off, _MM_HINT_T0);
}

/* One group's weight rows ready for the tiles, in sets of SUB rows side by side: codes as
 * [set][block][step 0..7][row 0..7][4 bytes] (step k: the block's weights 4k..4k+3 of each row; wu), their
 * absolute values for the signed types (wa), the blocks' scales [set][block][row] (dv), and the blocks'
 * minimums transposed [block][NGI] (mt; not written for the signed types, whose minimum is zero). The
 * GEMM_INT16 types' codes go to wu as int16, [set][block][pair 0..15][row 0..7][2] (pair p: weights 2p,
 * 2p + 1), and wa is not used. Rows past the group's last are zero. */
NS_ALWAYS_INLINE void unpack_group(int t, const BlockWeight *w, int64_t n0, int64_t cols, int64_t nb, uint8_t *wu,
                                   uint8_t *wa, float *dv, float *mt) {
    const int64_t sets = (cols + SUB - 1) / SUB;
    if (cols < NGI && !TYPE_SIGNED(t)) memset(mt, 0, sizeof(float) * (size_t)(nb * NGI)); /* else decode32 writes every minimum */
    for (int64_t g = 0; g < sets; g++) {
        const uint8_t *rows[SUB];
        const int64_t live = cols - g * SUB < SUB ? cols - g * SUB : SUB;
        for (int n = 0; n < SUB; n++) rows[n] = n < live ? (const uint8_t *)w->data + (n0 + g * SUB + n) * w->row_bytes : NULL;
        prefetch_rows(w, n0 + (g + 1) * SUB, SUB);
        for (int64_t b = 0; b < nb; b++) {
            __m256i q[SUB], steps[8];
            for (int n = 0; n < SUB; n++) { /* q[n] set in each branch: zeroing all of q first cost a rep stos */
                float d = 0.0f;
                if (rows[n]) {
                    const Sub32 s = decode32(t, rows[n], b);
                    q[n] = s.q;
                    d = s.s0;
                    if (!TYPE_SIGNED(t)) mt[b * NGI + g * SUB + n] = s.m;
                } else
                    q[n] = _mm256_setzero_si256();
                dv[(g * nb + b) * SUB + n] = d;
            }
            transpose8x32(q, steps);
            if (GEMM_INT16(t)) {
                /* step k as two int16 vectors [row][2 codes]: weights 4k, 4k + 1 and 4k + 2, 4k + 3 */
                static const uint8_t pairs[32] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                                  0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};
                const __m256i pick = _mm256_loadu_si256((const __m256i *)pairs);
                int16_t *dst = (int16_t *)wu + (g * nb + b) * 256;
                for (int k = 0; k < 8; k++) {
                    const __m256i v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(steps[k], pick), 0xD8);
                    _mm256_store_si256((__m256i *)(dst + k * 32), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v)));
                    _mm256_store_si256((__m256i *)(dst + k * 32 + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1)));
                }
                continue;
            }
            uint8_t *dst = wu + (g * nb + b) * 256, *adst = wa + (g * nb + b) * 256;
            for (int k = 0; k < 8; k++) {
                _mm256_store_si256((__m256i *)(dst + k * 32), steps[k]);
                if (TYPE_SIGNED(t)) _mm256_store_si256((__m256i *)(adst + k * 32), _mm256_abs_epi8(steps[k]));
            }
        }
    }
}

/* Outputs of one set of weight rows (lane n: row n) to o, the first `width` of them (SUB but at the
 * matrix's last rows). */
static inline void store_outputs(float *o, __m256 y, int64_t width) {
    if (width == SUB) _mm256_storeu_ps(o, y);
    else {
        _Alignas(32) float tmp[SUB];
        _mm256_store_ps(tmp, y);
        memcpy(o, tmp, sizeof(float) * (size_t)width);
    }
}

/* One set of SUB weight rows against one panel of TR rows of x: for each residue j, the fused
 * multiply-adds over blocks j, j + 8, ..., each block's integer products summed across its 8 steps in
 * int16 (WIDEN_STEPS at a time) and int32, then converted once for all SUB weight rows.
 * NS_KEEP_IN_REGISTER keeps each row's sum one chain: GCC otherwise reassociates the integer sums into a
 * tree whose 32 live products spill to the stack (measured: the GEMM 1.15-1.3x faster with it). */
NS_ALWAYS_INLINE void tile_partials(int t, const int8_t *qp, const float *const *sxr, const uint8_t *wu,
                                    const uint8_t *wa, const float *dv, int64_t nb, __m256 part[TR][8]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int W = WIDEN_STEPS(t);
    for (int j = 0; j < 8; j++) {
        __m256 acc[TR];
        for (int r = 0; r < TR; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = j; b < nb; b += 8) {
            const int8_t *xb = qp + b * TR * 32;
            __m256i tot[TR];
            for (int r = 0; r < TR; r++) tot[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int k0 = 0; k0 < 8; k0 += W) {
                __m256i h[TR];
                for (int k = k0; k < k0 + W; k++) {
                    const __m256i wv = _mm256_load_si256((const __m256i *)(wu + (b * 8 + k) * 32));
                    const __m256i av = TYPE_SIGNED(t) ? _mm256_load_si256((const __m256i *)(wa + (b * 8 + k) * 32)) : wv;
#pragma GCC unroll 4
                    for (int r = 0; r < TR; r++) {
                        int32_t x4;
                        memcpy(&x4, xb + r * 32 + k * 4, 4);
                        const __m256i xv = _mm256_set1_epi32(x4);
                        const __m256i p = TYPE_SIGNED(t) ? _mm256_maddubs_epi16(av, _mm256_sign_epi8(xv, wv))
                                                         : _mm256_maddubs_epi16(wv, xv);
                        h[r] = k == k0 ? p : _mm256_add_epi16(h[r], p);
                        NS_KEEP_IN_REGISTER(h[r]);
                    }
                }
                for (int r = 0; r < TR; r++) {
                    tot[r] = _mm256_add_epi32(tot[r], _mm256_madd_epi16(h[r], ones));
                    if (W == 1) NS_KEEP_IN_REGISTER(tot[r]); /* 8-bit codes: 8 widenings a block */
                }
            }
            const __m256 d = _mm256_load_ps(dv + b * SUB);
            for (int r = 0; r < TR; r++)
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[r]), _mm256_mul_ps(d, _mm256_broadcast_ss(sxr[r] + b)), acc[r]);
        }
        for (int r = 0; r < TR; r++) part[r][j] = acc[r];
    }
}

/* The GEMM_INT16 types' GEMM takes groups of NGI16 weight rows (two sets, which share each broadcast of x)
 * and runs its tiles over INT16_CHUNK_BLOCKS blocks at a time, every panel of x through one chunk before
 * the next, so that the chunk's codes (two sets of 24 blocks: 24 KiB) stay in the 32 KiB L1 with x's
 * (6 KiB a panel). int16 codes take twice the bytes of int8 ones: groups of 32 rows over whole rows
 * (36 KiB at K = 576) ran at 0.7x. */
#define NGI16 16
#define INT16_CHUNK_BLOCKS 24 /* a multiple of 8 */

/* tile_partials for the GEMM_INT16 types over blocks b0 .. b1 - 1: ns (1 or 2, a literal) sets of SUB
 * weight rows (int16 codes from w16, set s at s * nb * 256) against one panel of TR rows of x (q16), each
 * broadcast of two of x's codes shared by the sets; per block the exact integer sum of 16 vpmaddwd, then
 * tile_partials' fold into part (kept from the chunk before: for each residue j the fused multiply-adds
 * go on over blocks j, j + 8, ... in order). */
NS_ALWAYS_INLINE void tile_partials16(int ns, const int16_t *qp16, const float *const *sxr, const int16_t *w16,
                                      const float *dv, int64_t nb, int64_t b0, int64_t b1, __m256 part[2][TR][8]) {
    for (int64_t b = b0; b < b1; b++) {
        const int16_t *x16 = qp16 + b * TR * 32;
        __m256i tot[2][TR];
        for (int s = 0; s < ns; s++)
            for (int r = 0; r < TR; r++) tot[s][r] = _mm256_setzero_si256();
#pragma GCC unroll 16
        for (int k2 = 0; k2 < 16; k2++) { /* weights 2 k2, 2 k2 + 1 of each row */
            __m256i wv[2];
            for (int s = 0; s < ns; s++) {
                wv[s] = _mm256_load_si256((const __m256i *)(w16 + (s * nb + b) * 256 + k2 * 16));
                NS_KEEP_IN_REGISTER(wv[s]); /* loaded once, not once per row as a vpmaddwd operand */
            }
            for (int r = 0; r < TR; r++) {
                int32_t x2;
                memcpy(&x2, x16 + r * 32 + 2 * k2, 4);
                const __m256i xv = _mm256_set1_epi32(x2);
                for (int s = 0; s < ns; s++) {
                    tot[s][r] = _mm256_add_epi32(tot[s][r], _mm256_madd_epi16(wv[s], xv));
                    NS_KEEP_IN_REGISTER(tot[s][r]); /* one chain per output, as tile_partials' */
                }
            }
        }
        /* the fold into residue b mod 8's partial sum, in memory: held in registers through the block,
         * the eight of them and the eight integer sums did not fit in sixteen */
        for (int s = 0; s < ns; s++) {
            const __m256 d = _mm256_load_ps(dv + (s * nb + b) * SUB);
            for (int r = 0; r < TR; r++)
                part[s][r][b & 7] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot[s][r]), _mm256_mul_ps(d, _mm256_broadcast_ss(sxr[r] + b)),
                                                    b < 8 ? _mm256_setzero_ps() : part[s][r][b & 7]);
        }
    }
}

/* gemm_group for the GEMM_INT16 types (signed: no minimum term), NGI16 rows; part: the thread's
 * partial sums for every panel of the M rows, [panel][2][TR][8]. */
NS_ALWAYS_INLINE void gemm_group16(int t, const QuantizedRows *xq, const BlockWeight *w, float *out, int64_t ldo,
                                   int64_t i0, int64_t M, int64_t nb, int64_t n0, int64_t cols, uint8_t *wu, float *dv,
                                   __m256 (*part)[2][TR][8]) {
    const int64_t panels = (M + TR - 1) / TR, nbx = xs_blocks(nb), chunks = (nb + INT16_CHUNK_BLOCKS - 1) / INT16_CHUNK_BLOCKS;
    const int ns = cols > SUB ? 2 : 1;
    unpack_group(t, w, n0, cols, nb, wu, NULL, dv, NULL);
    if (nb < 8) memset(part, 0, sizeof(__m256) * (size_t)(panels * 2 * TR * 8)); /* else the first eight blocks set them */
    NextGroupPrefetch next = next_group_prefetch(w, n0, cols, NGI16, panels * chunks);
    for (int64_t b0 = 0; b0 < nb; b0 += INT16_CHUNK_BLOCKS) {
        const int64_t b1 = nb - b0 < INT16_CHUNK_BLOCKS ? nb : b0 + INT16_CHUNK_BLOCKS;
        for (int64_t p = 0; p < panels; p++) {
            const int16_t *qp16 = xq->q16 + (i0 / TR + p) * nb * TR * 32;
            const float *sxr[TR];
            for (int r = 0; r < TR; r++) sxr[r] = xq->sx + (i0 + p * TR + r) * nbx;
            if (ns == 2) tile_partials16(2, qp16, sxr, (const int16_t *)wu, dv, nb, b0, b1, part[p]);
            else tile_partials16(1, qp16, sxr, (const int16_t *)wu, dv, nb, b0, b1, part[p]);
            prefetch_slice(&next);
        }
    }
    for (int64_t p = 0; p < panels; p++)
        for (int s = 0; s < ns; s++) {
            const int64_t width = cols - s * SUB < SUB ? cols - s * SUB : SUB;
            for (int64_t r = 0; r < TR && p * TR + r < M; r++) {
                const int64_t i = i0 + p * TR + r;
                /* + 0 as gemm_group's zero minimum term (the same result, -0 included) */
                const __m256 y = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(xq->dx[i]), sum_partials(part[p][s][r])),
                                               _mm256_setzero_ps());
                store_outputs(out + i * ldo + n0 + s * SUB, y, width);
            }
        }
}

/* One group of weight rows (n0 .. n0 + cols - 1) against rows i0 .. i0 + M - 1 of x: unpack, minimum
 * terms, then the tiles. The scratch (wu, wa, dv, mt, m_terms) is the calling thread's. */
NS_ALWAYS_INLINE void gemm_group(int t, const QuantizedRows *xq, const BlockWeight *w, float *out, int64_t ldo,
                                 int64_t i0, int64_t M, int64_t nb, int64_t n0, int64_t cols, uint8_t *wu, uint8_t *wa,
                                 float *dv, float *mt, float *m_terms) {
    const int64_t panels = (M + TR - 1) / TR, sets = (cols + SUB - 1) / SUB, nbx = xs_blocks(nb);
    unpack_group(t, w, n0, cols, nb, wu, wa, dv, mt);
    /* the minimum term of every output, each lane one weight row: per residue j the fused multiply-adds
     * over blocks j, j + 8, ..., summed as stream_row's hsum256 (none for the signed types) */
    for (int64_t i = 0; i < M && !TYPE_SIGNED(t); i++) {
        __m256 part[NGI / 8][8];
        for (int j = 0; j < 8; j++) {
            __m256 a[NGI / 8];
            for (int v = 0; v < NGI / 8; v++) a[v] = _mm256_setzero_ps();
            for (int64_t b = j; b < nb; b += 8) {
                const __m256 s = _mm256_set1_ps(xq->sum[(i0 + i) * nb + b]);
                for (int v = 0; v < NGI / 8; v++) a[v] = _mm256_fmadd_ps(s, _mm256_loadu_ps(mt + b * NGI + v * 8), a[v]);
            }
            for (int v = 0; v < NGI / 8; v++) part[v][j] = a[v];
        }
        for (int v = 0; v < NGI / 8; v++) _mm256_storeu_ps(m_terms + i * NGI + v * 8, sum_partials(part[v]));
    }
    if (TYPE_SIGNED(t)) memset(m_terms, 0, sizeof(float) * (size_t)(M * NGI));
    NextGroupPrefetch next = next_group_prefetch(w, n0, cols, NGI, panels * sets);
    for (int64_t p = 0; p < panels; p++) {
        const int8_t *qp = xq->q + (i0 / TR + p) * nb * TR * 32;
        const int64_t rows = M - p * TR < TR ? M - p * TR : TR;
        const float *sxr[TR];
        for (int r = 0; r < TR; r++) sxr[r] = xq->sx + (i0 + p * TR + r) * nbx;
        for (int64_t g = 0; g < sets; g++) {
            __m256 part[TR][8];
            tile_partials(t, qp, sxr, wu + g * nb * 256, wa + g * nb * 256, dv + g * nb * SUB, nb, part);
            prefetch_slice(&next);
            const int64_t width = cols - g * SUB < SUB ? cols - g * SUB : SUB;
            for (int64_t r = 0; r < rows; r++) {
                const int64_t i = p * TR + r;
                const __m256 y = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(xq->dx[i0 + i]), sum_partials(part[r])),
                                               _mm256_loadu_ps(m_terms + i * NGI + g * SUB));
                store_outputs(out + (i0 + i) * ldo + n0 + g * SUB, y, width);
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
    const int64_t group_rows = GEMM_INT16(w->type) ? NGI16 : NGI, groups = (N + group_rows - 1) / group_rows;
#pragma omp parallel
    {
        uint8_t *wu = aligned_alloc(32, (size_t)(NGI * nb * 64)); /* int16 codes for GEMM_INT16 (NGI16 < NGI) */
        /* each path's own scratch: the int16 GEMM's partial sums, or the int8 tiles' |codes| and minimums */
        const int wide = GEMM_INT16(w->type);
        __m256(*part)[2][TR][8] = wide ? aligned_alloc(32, sizeof(__m256) * (size_t)((M + TR - 1) / TR * 2 * TR * 8)) : NULL;
        uint8_t *wa = wide ? NULL : aligned_alloc(32, (size_t)(NGI * nb * 32));
        float *dv = aligned_alloc(32, sizeof(float) * (size_t)(NGI * nb));
        float *mt = wide ? NULL : malloc(sizeof(float) * (size_t)(nb * NGI));
        float *m_terms = wide ? NULL : malloc(sizeof(float) * (size_t)(M * NGI)); /* [row][col] */
#pragma omp for GEMM_SCHEDULE
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * group_rows, cols = N - n0 < group_rows ? N - n0 : group_rows;
            switch (w->type) {
#define CASE(T)                                                                                                  \
    case T:                                                                                                      \
        if (GEMM_INT16(T)) gemm_group16(T, xq, w, out, ldo, i0, M, nb, n0, cols, wu, dv, part);                \
        else gemm_group(T, xq, w, out, ldo, i0, M, nb, n0, cols, wu, wa, dv, mt, m_terms);                     \
        break;
                FOR_EACH_BLOCK32_TYPE(CASE)
#undef CASE
            default: break;
            }
        }
        free(wu);
        free(part);
        free(wa);
        free(dv);
        free(mt);
        free(m_terms);
    }
}

/* The totals of eight blocks' 8-lane sums p[0..7], lane j: block j's (exact integers). */
static inline __m256i block_totals(const __m256i *p) {
    const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
    const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/* The scales d and minimums m of eight blocks b0 .. b0 + 7 of a row (n8 inside it, zero past its end),
 * as decode32 gives them: each 32-weight type starts its block with d as float16, Q4_1 and Q5_1 follow it
 * with m, and Q4_0 and Q5_0 take m = -8d and -16d. Eight half-floats converted at once. */
NS_ALWAYS_INLINE void block_scales8(int t, const uint8_t *row, int64_t b0, int n8, __m256 *d, __m256 *m) {
    int32_t h[8];
    for (int j = 0; j < 8; j++) {
        h[j] = 0;
        if (j < n8) memcpy(&h[j], row + (b0 + j) * type_block_bytes(t), 4);
    }
    __m256 hi;
    float16_pairs8(_mm256_setr_epi32(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]), d, &hi);
    if (t == T_Q4_1 || t == T_Q5_1) *m = hi;
    else if (t == T_Q4_0) *m = _mm256_mul_ps(*d, _mm256_set1_ps(-8.0f));
    else if (t == T_Q5_0) *m = _mm256_mul_ps(*d, _mm256_set1_ps(-16.0f));
    else *m = _mm256_setzero_ps();
}

/* Eight blocks b0 .. b0 + 7 of one weight row (n8 of them inside the row; past its end zero sums and
 * scales) into stream_row's accumulators: lane j of acc[i] takes block b0 + j. */
NS_ALWAYS_INLINE void stream_blocks(int t, const QuantizedRows *xq, const uint8_t *row, int64_t M, int64_t nb,
                                    int64_t b0, int n8, __m256 *acc, __m256 *m_acc) {
    /* the codes through L1 (the rows of x reload them): sixteen vectors would not stay in registers */
    _Alignas(32) uint8_t wv[8][32], wa[8][32];
    for (int j = 0; j < 8; j++) {
        __m256i q = _mm256_setzero_si256();
        if (j < n8) {
            /* with 2+ rows of x only, as k_stream_row (at 1 row: Q4_1 1.05x, Q8_0 1.11x, Q5_0 1.03x) */
            if (M > 1) _mm_prefetch((const char *)row + (b0 + j) * type_block_bytes(t) + STREAM_PREFETCH_BYTES, _MM_HINT_T0);
            q = decode32(t, row, b0 + j).q;
        }
        _mm256_store_si256((__m256i *)wv[j], q);
        if (TYPE_SIGNED(t)) _mm256_store_si256((__m256i *)wa[j], _mm256_abs_epi8(q));
    }
    __m256 dd, mm;
    block_scales8(t, row, b0, n8, &dd, &mm);
    const int64_t nbx = xs_blocks(nb);
#pragma GCC unroll 8
    for (int64_t i = 0; i < M; i++) {
        __m256i p[8];
        for (int j = 0; j < 8; j++) {
            if (j >= n8) { /* past the row's end (the last eight blocks only) */
                p[j] = _mm256_setzero_si256();
                continue;
            }
            const __m256i w = _mm256_load_si256((const __m256i *)wv[j]);
            const __m256i a = TYPE_SIGNED(t) ? _mm256_load_si256((const __m256i *)wa[j]) : w;
            p[j] = block_dot(t, w, a, _mm256_load_si256((const __m256i *)(xq->q + x_block_index(i, b0 + j, nb, M) * 32)));
        }
        const __m256 scale = _mm256_mul_ps(dd, _mm256_loadu_ps(xq->sx + i * nbx + b0));
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_totals(p)), scale, acc[i]);
        /* the minimum term (lanes past the row's end: sum * 0, sum padded and finite) */
        if (!TYPE_SIGNED(t)) m_acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xq->sum + i * nb + b0), mm, m_acc[i]);
    }
}

/* Up to STREAM_MAX_ROWS rows: each weight row's blocks are read once from memory and used for every row
 * of x (the step is bound by reading the weights), eight blocks at a time, with the GEMM's operations
 * per output in the GEMM's order. */
NS_ALWAYS_INLINE void stream_row(int t, const QuantizedRows *xq, const uint8_t *row, float *out, int64_t ldo,
                                 int64_t M, int64_t nb) {
    __m256 acc[STREAM_MAX_ROWS], m_acc[STREAM_MAX_ROWS];
    for (int64_t i = 0; i < M; i++) acc[i] = m_acc[i] = _mm256_setzero_ps();
    int64_t b0 = 0;
    for (; b0 + 8 <= nb; b0 += 8) stream_blocks(t, xq, row, M, nb, b0, 8, acc, m_acc);
    /* The row's last blocks past a multiple of 8, their count a literal for the common ones (SmolLM2's
     * 576 columns leave 2, 896 leave 4, 960 leave 6), so that the lanes past the row's end cost nothing:
     * 1 row of 576 columns took 1.4x the time per weight of 512 with the count a run-time value, 1.0x
     * with it a literal (Q4_1, Q5_0, Q8_0). */
    switch (nb - b0) {
    case 0: break;
#if defined(__AVX2__) /* the portable build: one copy (see STREAM_ROW_COUNTS) */
    case 2: stream_blocks(t, xq, row, M, nb, b0, 2, acc, m_acc); break;
    case 4: stream_blocks(t, xq, row, M, nb, b0, 4, acc, m_acc); break;
    case 6: stream_blocks(t, xq, row, M, nb, b0, 6, acc, m_acc); break;
#endif
    default: stream_blocks(t, xq, row, M, nb, b0, (int)(nb - b0), acc, m_acc); break;
    }
    for (int64_t i = 0; i < M; i++) out[i * ldo] = finish(xq->dx[i], acc[i], hsum256(m_acc[i]));
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

/* Rows of x per pass of the GEMM over the weights; each pass unpacks the weights again. Measured
 * (2026-12-03, AMD EPYC, 512 rows on SmolLM2's shapes and 256 on a 1B model's): 128 rows 1.1-1.25x as
 * fast as 64; 256 no faster than 128 (slower on Q8_0). */
#define CHUNK_ROWS 128

/* out (M, columns of w, row stride ldo) = x (M, K) W^T, W of a block type, x quantized per block of 32:
 * few rows stream the weight blocks (bound by memory), more rows go through the tiled GEMM; the K types
 * through k_quant_i8.c's kernels, with x's scale one per super-block. */
void weight_gemm_i8(const float *x, const BlockWeight *w, float *out, int64_t M, int64_t ldo) {
    const int64_t K = w->k, nb = K / 32, Mp = (M + TR - 1) / TR * TR;
    const int k_type = TYPE_IS_K(w->type);
    /* the blocks' sums of codes, for the minimum terms: every type but the signed 32-weight ones */
    const int sums = k_type || !TYPE_SIGNED(w->type);
    QuantizedRows xq = {.q = aligned_alloc(32, (size_t)(Mp * K)), .dx = malloc(sizeof(float) * (size_t)Mp),
                        .sum = sums ? calloc((size_t)(Mp * nb + 8), sizeof(float)) : NULL,
                        .sx = malloc(sizeof(float) * (size_t)(Mp * xs_blocks(nb))),
                        .qs16 = sums ? malloc(sizeof(int16_t) * (size_t)(Mp * nb * 2)) : NULL,
                        .qs32 = sums ? malloc(sizeof(int16_t) * (size_t)(Mp * (nb + 1))) : NULL,
                        .xk = malloc(sizeof(float) * (size_t)(Mp * k_xs_groups(nb))), .q16 = NULL, .q_pairs = NULL};
    const int64_t stream_max = GEMM_INT16(w->type) ? GEMM_INT16_STREAM_MAX_ROWS : STREAM_MAX_ROWS;
    if (!k_type && M > stream_max && GEMM_INT16(w->type)) /* x's codes widened too, for the GEMM */
        xq.q16 = aligned_alloc(32, sizeof(int16_t) * (size_t)(Mp * K));
    if (M > STREAM_MAX_ROWS && K_PAIRED(w->type)) xq.q_pairs = aligned_alloc(32, (size_t)(Mp * K));
    /* The streaming kernels read x's rows only, in one panel; the GEMM's tiles the padding rows too (as
     * zeros), in panels of TR */
    const int streams = M <= (k_type ? STREAM_MAX_ROWS : stream_max);
    quantize_rows(x, M, streams ? M : Mp, K, k_type ? K_GROUP_BLOCKS : 1, streams ? M : TR, &xq);
    if (streams && k_type) k_stream_i8(&xq, w, out, ldo, M);
    else if (streams) stream_rows(&xq, w, out, ldo, M, nb);
    else
        for (int64_t i0 = 0; i0 < M; i0 += CHUNK_ROWS) {
            const int64_t rows = M - i0 < CHUNK_ROWS ? M - i0 : CHUNK_ROWS;
            /* a K type's last few rows stream (quantized again, alone: each row's codes are its own) */
            if (k_type && rows <= STREAM_MAX_ROWS) weight_gemm_i8(x + i0 * K, w, out + i0 * ldo, rows, ldo);
            else if (k_type) k_gemm_i8(&xq, w, out, ldo, i0, rows);
            else gemm_rows(&xq, w, out, ldo, i0, rows, nb, w->n);
        }
    free(xq.q);
    free(xq.dx);
    free(xq.sum);
    free(xq.sx);
    free(xq.qs16);
    free(xq.qs32);
    free(xq.xk);
    free(xq.q16);
    free(xq.q_pairs);
}
