/* x quantized to 8 bits per block of 32 for the int8 products (int8_gemm.c quantizes it; int8_gemm.c and
 * k_quant_i8.c multiply it), and the one integer dot product of 32 weight codes with 32 of its values. */
#ifndef NANOSERVE_QUANTIZED_ROWS_H
#define NANOSERVE_QUANTIZED_ROWS_H

#include "simd.h"
#include <stdint.h>

#include "abi.h"
#include "quant_blocks.h"
#include "vec_math.h"

#define TR 4 /* rows of x per panel */

/* Block b of row i is x ~= dx[i] * s * q with q in -127..127 and s an integer in 1..32767, so a block's
 * scale is nearly as fine as a float's. Rows in panels: q as [panel][block][row][32] (x_block_index), s as
 * a float per [row][block] (sx, each row padded with zeros to a multiple of 8 blocks: xs_blocks), per [row][block]
 * the block's sum of q times s times dx (sum, for the weights' minimum terms; 8 zeros past its end), and per
 * [row][half-block] the sum of q alone over each 16 values as int16 (qs16, for the K types' integer
 * products with their minimums and offsets), and over each block's 32 as int16 in panels
 * [panel][pair of blocks][row][2] (qs32, for Q4_K / Q5_K's minimums, one per 32: a panel's rows side by
 * side, as the GEMM reads them). Rows past M are zero. For the K types s is one per
 * super-block of K_GROUP_BLOCKS blocks (llama.cpp's Q8_K: one scale per 256 values), so that their
 * products add integers over a whole super-block (k_quant_i8.c), and xk holds x's scale dx * s per
 * [row][super-block] (each row padded with zeros to a multiple of 8 super-blocks: k_xs_groups). */
typedef struct {
    int8_t *q;
    float *dx, *sum, *sx;
    int16_t *qs16, *qs32; /* sum, qs16 and qs32: NULL for the signed 32-weight types (no minimum term) */
    float *xk;
    int16_t *q16; /* q widened to int16, same layout (int8_gemm.c's GEMM_INT16 types' GEMM; else NULL) */
    int8_t *q_pairs; /* q with each block's halves interleaved (pair_halves; K_PAIRED types' GEMM; else NULL) */
} QuantizedRows;

/* The K types whose scale changes every 16 weights and whose codes are small (Q2_K 0..3, Q3_K 0..7): their
 * GEMM takes each block's 32 codes, of the weights and of x, with its halves interleaved by pairs of
 * values (pair_halves), so that one vpmaddubsw pair sum is of weights 0..15 and the next of 16..31: an
 * int16 lane pair then holds both halves' sums of a whole sub-block, and one vpmaddwd applies both scales
 * (not one per half). */
#define K_PAIRED(t) ((t) == T_Q2_K || (t) == T_Q3_K)

/* 32 bytes v0..v31 -> v0 v1 v16 v17 v2 v3 v18 v19 ... v14 v15 v30 v31 (4-byte step k: values 2k, 2k + 1 and
 * 16 + 2k, 17 + 2k). */
NS_ALWAYS_INLINE __m256i pair_halves(__m256i v) {
    /* 64-bit words 0 2 | 1 3: each 128-bit half holds values 8h..8h+7 and 16+8h..23+8h, interleaved by pairs */
    static const uint8_t order[32] = {0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                      0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15};
    return _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v, 0xD8), _mm256_loadu_si256((const __m256i *)order));
}

/* Blocks per row of sx: nb rounded up to a multiple of 8 (the streaming kernels read 8 blocks at a time). */
static inline int64_t xs_blocks(int64_t nb) { return (nb + 7) / 8 * 8; }

#define K_GROUP_BLOCKS 8

/* Super-blocks per row of xk: nb / K_GROUP_BLOCKS rounded up to a multiple of 8 (the K kernels fold eight
 * super-blocks at a time). */
static inline int64_t k_xs_groups(int64_t nb) { return (nb / K_GROUP_BLOCKS + 7) / 8 * 8; }

/* The eight partial sums S_j (lanes: the set's weight rows) summed in hsum256's order:
 * ((S0 + S4) + (S2 + S6)) + ((S1 + S5) + (S3 + S7)). */
static inline __m256 sum_partials(const __m256 *p) {
    const __m256 u0 = _mm256_add_ps(p[0], p[4]), u1 = _mm256_add_ps(p[1], p[5]);
    const __m256 u2 = _mm256_add_ps(p[2], p[6]), u3 = _mm256_add_ps(p[3], p[7]);
    return _mm256_add_ps(_mm256_add_ps(u0, u2), _mm256_add_ps(u1, u3));
}

/* Index in qs32 of row i's sum over block b. */
static inline int64_t qs32_index(int64_t i, int64_t nb, int64_t b) {
    return (((i / TR) * ((nb + 1) / 2) + b / 2) * TR + i % TR) * 2 + b % 2;
}

/* Eight 32-bit words, each two float16 (low, high half), as eight floats each: *lo from the low halves,
 * *hi from the high ones (the scales of eight blocks converted at once). */
static inline void float16_pairs8(__m256i words, __m256 *lo, __m256 *hi) {
    static const uint8_t halves[32] = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                       0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};
    const __m256i split = _mm256_shuffle_epi8(words, _mm256_loadu_si256((const __m256i *)halves));
    const __m256i both = _mm256_permutevar8x32_epi32(split, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(both));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(both, 1));
}

/* Index, in blocks of 32 codes, of row i's block b in q (and q16, q_pairs): rows in panels of `panel`, TR
 * for the tiled GEMMs (a tile's rows side by side), all M rows of a streaming product in one panel (each
 * weight block's x codes adjacent, a row's in M * K bytes). With TR-row panels one row of x spread over
 * 2K bytes of cache lines and left L1 with the weights streaming through: at one row, 2048 x 8192 Q4_K took
 * 2.05x, Q6_K 1.84x the time of one panel; 2048 x 5632 Q4_K 1.27x, Q6_K 1.54x, Q8_0 1.33x, Q4_1 1.32x; 576- to
 * 2048-wide products within noise (kernels_ab.py, 2026-12-07). */
static inline int64_t x_block_index(int64_t i, int64_t b, int64_t nb, int64_t panel) {
    return ((i / panel) * nb + b) * panel + i % panel;
}

/* The 32 products of a block's codes w with 32 quantized x, as 8 int32 sums (lane l: weights 4l..4l+3),
 * exact: |sum| <= 32 * 127 * 127. Signed codes multiply |w| by x with w's sign (vpmaddubsw takes unsigned
 * first operands); unsigned ones (0..63) multiply directly. No pair saturates: 2 * 127 * 127 < 32767. */
NS_ALWAYS_INLINE __m256i block_dot(int t, __m256i wv, __m256i wabs, __m256i xv) {
    const __m256i p = TYPE_SIGNED(t) ? _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv)) : _mm256_maddubs_epi16(wv, xv);
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

static inline int32_t hsum_epi32(__m256i t) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}

/* The streaming kernels (decode steps): up to STREAM_MAX_ROWS rows of x against one weight row at a
 * time, each thread's weight rows one sequential stream (with 2+ rows of x prefetched
 * STREAM_PREFETCH_BYTES ahead, quant_blocks.h). Several weight rows side by side were measured no faster
 * (2026-12-03, AMD EPYC: 2 or 4 rows at 1 row of x, 12% faster on weights in cache, up to 2x slower on
 * weights 4x the L3; 2026-12-06, two adjacent rows: equal in L3, 0.54-0.73x from memory). */
#define STREAM_MAX_ROWS 8 /* measured (nanoserve bench kernels, 65536 x 2048, 2026-12-03): at 6 and 8 rows
                             * the interleaved GEMM took 1.0-2.5x the streaming time (Q4_1 1.0-1.35x,
                             * Q5_0 2.0-2.5x, Q8_0 1.4-1.9x); at 16 it is faster */

/* out = dx * (the integer part's lanes summed) + (the minimum term): one function for every int8 kernel. */
static inline float finish(float dx, __m256 acc, float m_term) {
    return dx * hsum256(acc) + m_term;
}

/* One case of a streaming kernel's switch on the weight type: the weight rows shared between the threads
 * (RowShares, quant_blocks.h), in one region per type so that the type is a literal inside it (GCC
 * outlines OpenMP regions before it inlines), and M a literal, so that x's vectors and the accumulators
 * stay in registers (with M a run-time value GCC turned the loads into memcpy calls). Uses the caller's
 * xq, data, rb, N, out, ldo, M and nb. */
#if defined(__AVX2__)
#define STREAM_ROW_COUNTS(T, ROW)                                                                            \
    case 3: ROW(T, xq, data + n * rb, out + n, ldo, 3, nb); break;                                           \
    case 4: ROW(T, xq, data + n * rb, out + n, ldo, 4, nb); break;                                           \
    case 5: ROW(T, xq, data + n * rb, out + n, ldo, 5, nb); break;                                           \
    case 6: ROW(T, xq, data + n * rb, out + n, ldo, 6, nb); break;                                           \
    case 7: ROW(T, xq, data + n * rb, out + n, ldo, 7, nb); break;                                           \
    case 8: ROW(T, xq, data + n * rb, out + n, ldo, 8, nb); break;
#else /* the portable build: one copy for 3+ rows (eight literal copies of plain C took minutes to compile) */
#define STREAM_ROW_COUNTS(T, ROW)
#endif
#define STREAM_ROWS_CASE(T, ROW)                                                                             \
    case T:                                                                                                  \
        FOR_EACH_SHARED_ROW(N, rb, n, {                                                                      \
            switch (M) {                                                                                     \
            case 1: ROW(T, xq, data + n * rb, out + n, ldo, 1, nb); break;                                   \
            case 2: ROW(T, xq, data + n * rb, out + n, ldo, 2, nb); break;                                   \
            STREAM_ROW_COUNTS(T, ROW)                                                                        \
            default: ROW(T, xq, data + n * rb, out + n, ldo, M, nb); break;                                  \
            }                                                                                                \
        });                                                                                                  \
        break;

/* out = x W^T for W of a K type, x quantized in xq with one s per super-block (k_quant_i8.c): the
 * weights streamed against M <= STREAM_MAX_ROWS rows in one panel (k_stream_i8), or the tiled GEMM on rows
 * i0 .. i0 + M - 1 (i0 a multiple of TR) in TR-row panels (k_gemm_i8). */
void k_stream_i8(const QuantizedRows *xq, const BlockWeight *w, float *out, int64_t ldo, int64_t M);
void k_gemm_i8(const QuantizedRows *xq, const BlockWeight *w, float *out, int64_t ldo, int64_t i0, int64_t M);

#endif
