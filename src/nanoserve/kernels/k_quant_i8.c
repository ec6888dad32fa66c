/* x W^T for W of a K type (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K), x quantized to 8 bits with one scale per
 * super-block of 256 (quantized_rows.h, as llama.cpp's Q8_K): within a super-block every product is an
 * integer, so the sub-blocks' scales multiply in vpmaddwd and the sums add as integers (exact); one float
 * multiply-add per super-block then applies d (the weights') times x's scale. Decode steps stream the
 * weights; more rows run a GEMM with 8 weight rows side by side per vector. Both take the same operations
 * in the same order for each output, so a row's result does not depend on its batch: per super-block g
 * the integers T_g and M_g (the minimums' dot with x's sums), then for each residue j the fused
 * multiply-adds A_j of T_g * (d * xs) and N_j of M_g * -(dmin * xs) over g = j, j + 8, ... in order
 * (a vector lane each in the streaming kernel), out = (the A_j summed as hsum256 sums lanes) + (the N_j
 * likewise). */
/* No fused a * b + c or reordered sums that one kernel would get and the other not (the build allows both). */
#pragma GCC optimize("fp-contract=off", "no-associative-math")
#include "simd.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "quant_blocks.h"
#include "quantized_rows.h"
#include "vec_math.h"

/* One super-block's scales as its integer products need them. Every type's codes are unsigned (Q6_K's
 * stored 0..63, its offset of 32 taken as a minimum; Q3_K's 0..7, offset 4), so each sub-block is one
 * vpmaddubsw and one vpmaddwd by its multipliers k_sc(t, ks, j): 16 int16, Q4_K / Q5_K's six-bit scale in every
 * lane, Q2_K / Q3_K / Q6_K the scale of weights 0..15 in lanes 0-7 and of 16..31 in 8-15 (the layout of
 * vpmaddubsw's pair sums). pairs: the scale of each 16 weights, mn16: their minimum, 16 int16 each (lane l:
 * weights 16 l..; Q4_K / Q5_K: the sub-block's scale or minimum twice; Q2_K: its four-bit minimums; Q3_K
 * / Q6_K: their scales, with dmin = 4 d / 32 d). No sum overflows: a sub-block's int32 lane is at most
 * 4 * 63 * 127 * 128 (Q6_K), a super-block's eight times that. mn32 (Q4_K / Q5_K): the eight minimums as
 * int16 in lanes 0..7 (pairs (2p, 2p + 1) in 32-bit lane p), for the GEMM's products with x's sums per 32. */
typedef struct {
    __m256i sc_low, sc_high; /* the int16 scales k_sc picks from: those of sub-blocks 0..3 and 4..7 */
    __m256i pairs, mn16, mn32;
    float d, dmin;
} KIntScales;

NS_ALWAYS_INLINE void k_int_scales(int t, const uint8_t *p, KIntScales *ks) {
    if (t == T_Q2_K || t == T_Q3_K || t == T_Q6_K) {
        /* 16 scales as int8, one per 16 weights (Q2_K: the low nibbles of its scale bytes; Q3_K: six bits
         * less 32), and what the minimum term multiplies x's sums per 16 by, with dmin: Q2_K its high
         * nibbles and dmin, Q3_K the scales and 4 d (its codes' offset of 4), Q6_K the scales and 32 d */
        __m128i sc;
        if (t == T_Q6_K) sc = _mm_loadu_si128((const __m128i *)(p + 192));
        else if (t == T_Q2_K) sc = _mm_and_si128(_mm_loadu_si128((const __m128i *)p), _mm_set1_epi8(0x0F));
        else sc = q3_k_scales(p + 96);
        /* the 16 scales as int16 (pairs (2j, 2j + 1) in 32-bit lane j); sub-block j's multipliers take
         * scale 2j in the low half and 2j + 1 in the high half, one byte shuffle of scales 0..7 (j < 4) or
         * 8..15 in both halves */
        const __m256i all = _mm256_cvtepi8_epi16(sc);
        ks->sc_low = _mm256_permute2x128_si256(all, all, 0x00);
        ks->sc_high = _mm256_permute2x128_si256(all, all, 0x11);
        const __m128i mn = t == T_Q2_K ? _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128((const __m128i *)p), 4),
                                                       _mm_set1_epi8(0x0F)) : sc;
        ks->pairs = all;
        ks->mn16 = _mm256_cvtepi8_epi16(mn);
        ks->d = f16_at(p + (t == T_Q6_K ? 208 : t == T_Q3_K ? 108 : 80));
        ks->dmin = t == T_Q6_K ? 32.0f * ks->d : t == T_Q3_K ? 4.0f * ks->d : f16_at(p + 82);
        return;
    }
    /* the 12 bytes of six-bit scales and minimums (k_scale_min), eight at a time in general registers and
     * moved to vectors from there, not stored as four 32-bit words and loaded 8 bytes at a time (a load
     * spanning two stores is not forwarded; measured 1.02-1.04x at 1 row, of the ~23% of Q4_K's streaming
     * time that its scales take) */
    uint32_t u[3];
    memcpy(u, p + 4, 12);
    const uint64_t scales = (u[0] & 0x3f3f3f3f)                                                    /* 0..3 */
                            | (uint64_t)((u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4)) << 32;
    const uint64_t mins = (u[1] & 0x3f3f3f3f)                                                      /* 0..3 */
                          | (uint64_t)(((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4)) << 32;
    const __m128i sv = _mm_cvtsi64_si128((long long)scales), mv = _mm_cvtsi64_si128((long long)mins);
    /* sub-block j's multipliers: its scale (int16 lane j of the eight, in both halves) in every lane */
    const __m256i s16 = _mm256_cvtepu8_epi16(sv); /* scales <= 63 */
    ks->sc_low = ks->sc_high = _mm256_permute2x128_si256(s16, s16, 0x00);
    /* a scale (minimum) per 32 weights: sub-block j's in both int16 of 32-bit lane j */
    const __m256i s32 = _mm256_cvtepu8_epi32(sv), m32 = _mm256_cvtepu8_epi32(mv);
    ks->pairs = _mm256_or_si256(s32, _mm256_slli_epi32(s32, 16));
    ks->mn16 = _mm256_or_si256(m32, _mm256_slli_epi32(m32, 16));
    ks->mn32 = _mm256_cvtepu8_epi16(mv);
    ks->d = f16_at(p);
    ks->dmin = f16_at(p + 2);
}

/* Sub-block j's vpmaddwd multipliers (KIntScales), one byte shuffle where they are used, not eight
 * vectors held from k_int_scales on (they spilled to the stack). */
NS_ALWAYS_INLINE __m256i k_sc(int t, const KIntScales *ks, int j) {
    if (t == T_Q4_K || t == T_Q5_K) return _mm256_shuffle_epi8(ks->sc_low, _mm256_set1_epi16((int16_t)(0x0100 + 0x0202 * j)));
    /* scale 2j in the low half and 2j + 1 in the high half: of scales 0..7 (j < 4) or 8..15 */
    const int32_t a = 0x01000100 + 0x02020202 * ((2 * j) & 7), b = a + 0x02020202;
    return _mm256_shuffle_epi8(j < 4 ? ks->sc_low : ks->sc_high, _mm256_setr_epi32(a, a, a, a, b, b, b, b));
}

/* The codes of sub-block j, unsigned (see KIntScales), and their integer products with x's codes times
 * the sub-block's multipliers. */
NS_ALWAYS_INLINE __m256i k_unsigned_codes(int t, const uint8_t *p, int j) {
    return t == T_Q6_K ? q6_k_unsigned_codes(p, j) : t == T_Q3_K ? q3_k_unsigned_codes(p, j) : k_codes(t, p, j);
}

NS_ALWAYS_INLINE __m256i k_dot(__m256i w, __m256i xv, __m256i sc) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), sc);
}

/* Per 32-bit lane, the minimums' products with x's sums of codes per 16 over super-block g (mn16 times qs16
 * in vpmaddwd): their total, an integer below 2^24, is the same exact value however it is summed. */
static inline __m256i k_min_products(__m256i mn16, const QuantizedRows *xq, int64_t i, int64_t nb, int64_t g) {
    return _mm256_madd_epi16(mn16, _mm256_loadu_si256((const __m256i *)(xq->qs16 + (i * nb + g * 8) * 2)));
}

/* Eight super-blocks' integer sums (v[k] = vphaddd of super-block k's code products and minimum products:
 * T01 T23 M01 M23 | T45 T67 M45 M67 in 32-bit lanes) -> *tot lane k = T_k, *min lane k = M_k. Exact. */
static inline void k_totals8(const __m256i *v, __m256i *tot, __m256i *min) {
    const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]); /* T0 M0 T1 M1 halves */
    const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i c0 = _mm256_add_epi32(_mm256_permute2x128_si256(a0, a1, 0x20), _mm256_permute2x128_si256(a0, a1, 0x31));
    const __m256i c1 = _mm256_add_epi32(_mm256_permute2x128_si256(a2, a3, 0x20), _mm256_permute2x128_si256(a2, a3, 0x31));
    const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7); /* T0 M0 T1 M1 T2 M2 T3 M3 -> T0..T3 M0..M3 */
    const __m256i p0 = _mm256_permutevar8x32_epi32(c0, split), p1 = _mm256_permutevar8x32_epi32(c1, split);
    *tot = _mm256_permute2x128_si256(p0, p1, 0x20);
    *min = _mm256_permute2x128_si256(p0, p1, 0x31);
}

/* The fold of one super-block's integers (lanes: residues in k_stream_row, weight rows in k_tile) into
 * A_j and N_j: the one sequence of operations both kernels run, so that their results are identical
 * (the GEMM may run the two halves in separate loops: K_MIN_APART). */
NS_ALWAYS_INLINE void k_fold_sum(__m256i tot, __m256 d, __m256 xs, __m256 *acc) {
    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(d, xs), *acc);
}
NS_ALWAYS_INLINE void k_fold_min(__m256i min, __m256 dmin, __m256 xs, __m256 *m_acc) {
    *m_acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(min), _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, xs)), *m_acc);
}
NS_ALWAYS_INLINE void k_fold(__m256i tot, __m256i min, __m256 d, __m256 dmin, __m256 xs, __m256 *acc, __m256 *m_acc) {
    k_fold_sum(tot, d, xs, acc);
    k_fold_min(min, dmin, xs, m_acc);
}

/* d and dmin (KIntScales') of super-blocks g0 .. g0 + 7 of a row (n8 inside it; zero past its end),
 * converted at once: Q2_K / Q4_K / Q5_K keep them as two float16 side by side, Q3_K / Q6_K only d (read
 * with the two bytes before it, which every such block has), dmin 4 d / 32 d. One conversion per
 * eight super-blocks, not two per super-block (measured: Q4_K at 1 row ~5% faster). */
NS_ALWAYS_INLINE void k_scales8(int t, const uint8_t *row, int64_t g0, int n8, __m256 *d, __m256 *dmin) {
    const int64_t bytes = type_block_bytes(t);
    const int64_t at = t == T_Q6_K ? 206 : t == T_Q3_K ? 106 : t == T_Q2_K ? 80 : 0;
    int32_t h[8];
    for (int k = 0; k < 8; k++) {
        h[k] = 0;
        if (k < n8) memcpy(&h[k], row + (g0 + k) * bytes + at, 4);
    }
    __m256 lo, hi;
    float16_pairs8(_mm256_setr_epi32(h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]), &lo, &hi);
    if (t == T_Q6_K || t == T_Q3_K) {
        *d = hi;
        *dmin = _mm256_mul_ps(hi, _mm256_set1_ps(t == T_Q6_K ? 32.0f : 4.0f));
    } else {
        *d = lo;
        *dmin = hi;
    }
}

/* One weight row against the M <= STREAM_MAX_ROWS rows of x (one panel): eight super-blocks at a time,
 * super-block g0 + k's sums in lane k, so that lane k's fused multiply-adds are the GEMM's for residue k. */
NS_ALWAYS_INLINE void k_stream_row(int t, const QuantizedRows *xq, const uint8_t *row, float *out, int64_t ldo,
                                   int64_t M, int64_t nb) {
    const int64_t bytes = type_block_bytes(t), ng = nb / 8, ngx = k_xs_groups(nb);
    __m256 acc[STREAM_MAX_ROWS], m_acc[STREAM_MAX_ROWS];
    for (int64_t i = 0; i < M; i++) acc[i] = m_acc[i] = _mm256_setzero_ps();
    for (int64_t g0 = 0; g0 < ng; g0 += 8) {
        const int n8 = ng - g0 < 8 ? (int)(ng - g0) : 8;
        __m256i v[STREAM_MAX_ROWS][8];
        for (int k = 0; k < 8; k++) {
            if (k >= n8) {
                for (int64_t i = 0; i < M; i++) v[i][k] = _mm256_setzero_si256();
                continue;
            }
            const int64_t g = g0 + k;
            const uint8_t *p = row + g * bytes;
            /* asked for ahead with 2+ rows of x; at one row the hardware's prefetch alone was faster
             * (bench kernels 65536 x 2048, min of 3-4 alternations: Q4_K 1.08-1.13x, Q6_K 1.01-1.21x; with
             * 8 rows 0.94x and 0.80x) */
            if (M > 1)
                for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + STREAM_PREFETCH_BYTES + o, _MM_HINT_T0);
            KIntScales ks;
            k_int_scales(t, p, &ks);
            __m256i isum[STREAM_MAX_ROWS];
            for (int64_t i = 0; i < M; i++) isum[i] = _mm256_setzero_si256();
            /* unrolled, so that each sub-block's shifts and offsets in k_codes are constants */
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m256i w = k_unsigned_codes(t, p, j), sc = k_sc(t, &ks, j);
                for (int64_t i = 0; i < M; i++) {
                    const __m256i xv = _mm256_load_si256((const __m256i *)(xq->q + x_block_index(i, 8 * g + j, nb, M) * 32));
                    isum[i] = _mm256_add_epi32(isum[i], k_dot(w, xv, sc));
                    NS_KEEP_IN_REGISTER(isum[i]);
                }
            }
            for (int64_t i = 0; i < M; i++) v[i][k] = _mm256_hadd_epi32(isum[i], k_min_products(ks.mn16, xq, i, nb, g));
        }
        __m256 dv, dminv;
        k_scales8(t, row, g0, n8, &dv, &dminv);
        for (int64_t i = 0; i < M; i++) {
            __m256i tot, min;
            k_totals8(v[i], &tot, &min);
            k_fold(tot, min, dv, dminv, _mm256_loadu_ps(xq->xk + i * ngx + g0), &acc[i], &m_acc[i]);
        }
    }
    for (int64_t i = 0; i < M; i++) out[i * ldo] = hsum256(acc[i]) + hsum256(m_acc[i]);
}

#define SUB 8  /* weight rows side by side in the GEMM's vectors, one per lane */
#define NGI 16 /* weight rows unpacked per group: a multiple of SUB */

/* Pairs of minimums per super-block in the GEMM's minimum term: Q4_K / Q5_K have one per 32 weights
 * (KIntScales.mn32 against x's sums per 32, four vpmaddwd), the others one per 16 (mn16, against qs16). */
#define K_MIN_PAIRS(t) ((t) == T_Q4_K || (t) == T_Q5_K ? 4 : 8)

/* Sets of SUB weight rows per tile: two share each broadcast of x where the int16 sums stay in registers
 * (bench kernels 16384 x 2048, min of 4 alternations: Q4_K 16-128 rows 1.06-1.08x; Q6_K 0.87-0.92x at
 * 128 rows, where the two sets' sums spill). Q2_K / Q3_K with their halves paired (K_PAIRED) and Q5_K:
 * gemm.py on a 1.1B Llama's shapes, alternated 3-4 times, 32-512 rows 1.05-1.19x (2026-12-07). */
#define K_TILE_SETS(t) ((t) == T_Q4_K || (t) == T_Q5_K || K_PAIRED(t) ? 2 : 1)

/* Steps (4 weights of each row) whose vpmaddubsw pair sums one int16 lane holds before vpmaddwd applies
 * the sub-block's scale: 8 of 4-bit codes (16 * 15 * 127 < 32767), 4 of 5-bit, 2 of 6-bit (4 * 63 * 127).
 * Q2_K's and Q3_K's 2- and 3-bit codes take a scale per 16 weights: with their halves paired (K_PAIRED),
 * an int16 lane holds one half's sums and its neighbour the other's, 8 steps (8 * 2 * 7 * 127). */
#define K_WIDEN_STEPS(t) ((t) == T_Q4_K || K_PAIRED(t) ? 8 : (t) == T_Q5_K ? 4 : 2)

/* A group's weight rows ready for the tiles, in sets of SUB rows side by side (per set and super-block):
 * codes [sub-block][step 0..7][row 0..7][4 bytes] (256 bytes a sub-block; K_PAIRED types' codes with
 * their halves paired), vpmaddwd multipliers [sub-block][half][16 int16] (32-bit lane n: row n's scale of
 * the sub-block's weights 0..15 or 16..31 in both int16; K_PAIRED types: [sub-block][0] only, lane n row
 * n's two scales, of weights 0..15 in its low int16 and of 16..31 in its high one),
 * d and dmin [row], and the minimums (KIntScales.mn16 or mn32, small integers) as int16 pairs
 * [pair][row][2] (K_MIN_PAIRS of them), vpmaddwd multipliers of x's sums per 16 or 32. Rows past the
 * group's last are zero. */
typedef struct {
    uint8_t *codes;
    int16_t *sc;
    float *d, *dmin;
    int16_t *mn;
} KGroup;

NS_ALWAYS_INLINE void k_unpack_group(int t, const BlockWeight *w, int64_t n0, int64_t cols, int64_t nb, KGroup *u) {
    const int64_t ng = nb / 8, bytes = type_block_bytes(t), sets = (cols + SUB - 1) / SUB;
    for (int64_t s = 0; s < sets; s++) {
        const int64_t live = cols - s * SUB < SUB ? cols - s * SUB : SUB;
        for (int64_t g = 0; g < ng; g++) {
            const int64_t sg = s * ng + g;
            __m256i codes[8][SUB];                   /* [sub-block][row] */
            __m256i pairs[SUB], mins[SUB], across[8]; /* [row]: KIntScales.pairs and .mn16 */
            for (int n = 0; n < SUB; n++) {
                if (n >= live) {
                    for (int j = 0; j < 8; j++) codes[j][n] = _mm256_setzero_si256();
                    pairs[n] = mins[n] = _mm256_setzero_si256();
                    u->d[sg * SUB + n] = u->dmin[sg * SUB + n] = 0.0f;
                    continue;
                }
                const uint8_t *p = (const uint8_t *)w->data + (n0 + s * SUB + n) * w->row_bytes + g * bytes;
                KIntScales ks;
                k_int_scales(t, p, &ks);
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++) codes[j][n] = K_PAIRED(t) ? pair_halves(k_unsigned_codes(t, p, j)) : k_unsigned_codes(t, p, j);
                pairs[n] = ks.pairs;
                mins[n] = K_MIN_PAIRS(t) == 4 ? ks.mn32 : ks.mn16;
                u->d[sg * SUB + n] = ks.d;
                u->dmin[sg * SUB + n] = ks.dmin;
            }
            /* the rows' scales side by side: across[j] lane n = row n's pair (scale of weights 0..15, of 16..31)
             * of sub-block j, each copied into both int16 of its lane for its half's multipliers */
            transpose8x32(pairs, across);
            /* byte indices within each 128-bit half: lane k takes bytes 4k, 4k + 1 (or 4k + 2, 4k + 3) twice */
            const __m256i first = _mm256_setr_epi32(0x01000100, 0x05040504, 0x09080908, 0x0D0C0D0C, 0x01000100, 0x05040504,
                                                    0x09080908, 0x0D0C0D0C);
            const __m256i second = _mm256_add_epi32(first, _mm256_set1_epi32(0x02020202));
            for (int j = 0; j < 8; j++) {
                if (K_PAIRED(t)) { /* one multiplier vector a sub-block: lane n row n's pair, as it is */
                    _mm256_store_si256((__m256i *)(u->sc + sg * 256 + (2 * j) * 16), across[j]);
                    continue;
                }
                _mm256_store_si256((__m256i *)(u->sc + sg * 256 + (2 * j) * 16), _mm256_shuffle_epi8(across[j], first));
                _mm256_store_si256((__m256i *)(u->sc + sg * 256 + (2 * j + 1) * 16), _mm256_shuffle_epi8(across[j], second));
            }
            transpose8x32(mins, across); /* across[l2] lane n = row n's minimums 2 l2, 2 l2 + 1 */
            for (int l2 = 0; l2 < K_MIN_PAIRS(t); l2++) _mm256_store_si256((__m256i *)(u->mn + (sg * 8 + l2) * 16), across[l2]);
            for (int j = 0; j < 8; j++) {
                __m256i steps[8];
                transpose8x32(codes[j], steps);
                for (int k = 0; k < 8; k++) _mm256_store_si256((__m256i *)(u->codes + (sg * 8 + j) * 256 + k * 32), steps[k]);
            }
        }
    }
}

/* The minimum term runs in its own loop (k_tile_min) where a tile holds two sets: inside k_tile its sums
 * and accumulators made the two sets' sums spill (8192 x 2048 against the term inside, alternated: Q4_K 32
 * rows 1.04-1.05x, 128 rows 1.06-1.12x apart), while with one set it is cheaper inside (Q6_K, Q3_K, Q2_K
 * 0.96-0.99x apart). Same operations per output either way. */
#define K_MIN_APART(t) (K_TILE_SETS(t) == 2)

/* The minimums' dot with x's sums of codes for super-block sg of one set and TR rows of x from row i, as
 * integers (the same integer as k_stream_row's M_g, which takes Q4_K / Q5_K's sums per 16): one vpmaddwd
 * per pair of x's sums and row. */
NS_ALWAYS_INLINE void k_min_dot(int t, const QuantizedRows *xq, int64_t i, int64_t nb, const KGroup *u, int64_t sg,
                                int64_t g, __m256i md[TR]) {
    for (int r = 0; r < TR; r++) md[r] = _mm256_setzero_si256();
    const int16_t *qs32 = xq->qs32 + qs32_index(i, nb, g * 8); /* the panel's pairs, rows side by side */
    for (int l2 = 0; l2 < K_MIN_PAIRS(t); l2++) {
        const __m256i mn = _mm256_load_si256((const __m256i *)(u->mn + (sg * 8 + l2) * 16));
        for (int r = 0; r < TR; r++) {
            int32_t pair;
            memcpy(&pair, K_MIN_PAIRS(t) == 4 ? qs32 + (l2 * TR + r) * 2 : xq->qs16 + ((i + r) * nb + g * 8) * 2 + 2 * l2, 4);
            md[r] = _mm256_add_epi32(md[r], _mm256_madd_epi16(mn, _mm256_set1_epi32(pair)));
        }
    }
}

/* ns (1 or 2, a literal) sets of SUB weight rows (their unpacked super-blocks from sg0 and sg0 + ng) against
 * one panel of TR rows of x (from row i of xq): the outputs of set s's rows (without their minimum term
 * where K_MIN_APART: k_tile_min adds it), lane n for row n, in y[s][r]. Two sets share each broadcast of
 * x's values (half the broadcasts per product). */
NS_ALWAYS_INLINE void k_tile(int t, int ns, const QuantizedRows *xq, const int8_t *qp, int64_t i, int64_t nb,
                             const KGroup *u, int64_t sg0, __m256 y[2][TR]) {
    const int64_t ng = nb / 8, ngx = k_xs_groups(nb);
    const int W = K_WIDEN_STEPS(t);
    __m256 part[2][TR][8], m_part[2][TR][8]; /* per residue j: the fused multiply-adds over super-blocks j, j + 8, ... */
    for (int j8 = 0; j8 < 8; j8++) {
        __m256 acc[2][TR], m[2][TR];
        for (int s = 0; s < ns; s++)
            for (int r = 0; r < TR; r++) acc[s][r] = m[s][r] = _mm256_setzero_ps();
        for (int64_t g = j8; g < ng; g += 8) {
            __m256i tot[2][TR];
            for (int s = 0; s < ns; s++)
                for (int r = 0; r < TR; r++) tot[s][r] = _mm256_setzero_si256();
            for (int j = 0; j < 8; j++) {
                const int8_t *xb = qp + (8 * g + j) * TR * 32;
                for (int k0 = 0; k0 < 8; k0 += W) {
                    __m256i h[2][TR];
                    /* unrolled: GCC left Q4_K's 8 steps a loop, its first-step test (k == k0) a branch
                     * in every step and its counters as many instructions as the products (Q4_K 32
                     * rows 1.11x, 128 rows 1.14x as fast unrolled; the other types unchanged) */
#pragma GCC unroll 8
                    for (int k = k0; k < k0 + W; k++) {
                        __m256i wv[2];
                        for (int s = 0; s < ns; s++) {
                            wv[s] = _mm256_load_si256((const __m256i *)(u->codes + ((sg0 + s * ng + g) * 8 + j) * 256 + k * 32));
                            NS_KEEP_IN_REGISTER(wv[s]); /* once a step, not once per row of x (GCC reloaded the
                                                         * second set's): scripts/kernels_ab.py, Q2_K / Q3_K
                                                         * 1.02-1.03x, Q4_K 1.01-1.02x, Q5_K 1.00x */
                        }
                        for (int r = 0; r < TR; r++) {
                            int32_t x4;
                            memcpy(&x4, xb + r * 32 + k * 4, 4);
                            const __m256i xv = _mm256_set1_epi32(x4);
                            for (int s = 0; s < ns; s++) {
                                const __m256i p = _mm256_maddubs_epi16(wv[s], xv);
                                h[s][r] = k == k0 ? p : _mm256_add_epi16(h[s][r], p);
                                NS_KEEP_IN_REGISTER(h[s][r]); /* a chain per row: see int8_gemm.c's tile_partials */
                            }
                        }
                    }
                    for (int s = 0; s < ns; s++) {
                        const __m256i sc = _mm256_load_si256((const __m256i *)(u->sc + (sg0 + s * ng + g) * 256 + (2 * j + k0 / 4) * 16));
                        for (int r = 0; r < TR; r++) {
                            tot[s][r] = _mm256_add_epi32(tot[s][r], _mm256_madd_epi16(h[s][r], sc));
                            /* one chain per output: with 2 steps a widening (Q6_K) GCC kept every vpmaddwd's
                             * result for a later sum, 16 of them spilled to the stack */
                            if (K_TILE_SETS(t) == 1) NS_KEEP_IN_REGISTER(tot[s][r]);
                        }
                    }
                }
            }
            for (int s = 0; s < ns; s++) {
                const int64_t sg = sg0 + s * ng + g;
                const __m256 d = _mm256_load_ps(u->d + sg * SUB);
                if (K_MIN_APART(t)) {
                    for (int r = 0; r < TR; r++) k_fold_sum(tot[s][r], d, _mm256_set1_ps(xq->xk[(i + r) * ngx + g]), &acc[s][r]);
                    continue;
                }
                __m256i md[TR];
                k_min_dot(t, xq, i, nb, u, sg, g, md);
                const __m256 dmin = _mm256_load_ps(u->dmin + sg * SUB);
                for (int r = 0; r < TR; r++)
                    k_fold(tot[s][r], md[r], d, dmin, _mm256_set1_ps(xq->xk[(i + r) * ngx + g]), &acc[s][r], &m[s][r]);
            }
        }
        for (int s = 0; s < ns; s++)
            for (int r = 0; r < TR; r++) {
                part[s][r][j8] = acc[s][r];
                m_part[s][r][j8] = m[s][r];
            }
    }
    for (int s = 0; s < ns; s++)
        for (int r = 0; r < TR; r++)
            y[s][r] = K_MIN_APART(t) ? sum_partials(part[s][r]) : _mm256_add_ps(sum_partials(part[s][r]), sum_partials(m_part[s][r]));
}

/* The minimum term of one set of SUB weight rows (unpacked super-blocks from sg0) against one panel of TR
 * rows of x (from row i), where K_MIN_APART: per super-block k_min_dot, then N_j's fused multiply-adds over
 * super-blocks j, j + 8, ... and their sum, lane n for weight row n. */
NS_ALWAYS_INLINE void k_tile_min(int t, const QuantizedRows *xq, int64_t i, int64_t nb, const KGroup *u, int64_t sg0,
                                 __m256 y[TR]) {
    const int64_t ng = nb / 8, ngx = k_xs_groups(nb);
    __m256 m_part[TR][8];
    for (int j8 = 0; j8 < 8; j8++) {
        __m256 m[TR];
        for (int r = 0; r < TR; r++) m[r] = _mm256_setzero_ps();
        for (int64_t g = j8; g < ng; g += 8) {
            __m256i md[TR];
            k_min_dot(t, xq, i, nb, u, sg0 + g, g, md);
            const __m256 dmin = _mm256_load_ps(u->dmin + (sg0 + g) * SUB);
            for (int r = 0; r < TR; r++) k_fold_min(md[r], dmin, _mm256_set1_ps(xq->xk[(i + r) * ngx + g]), &m[r]);
        }
        for (int r = 0; r < TR; r++) m_part[r][j8] = m[r];
    }
    for (int r = 0; r < TR; r++) y[r] = sum_partials(m_part[r]);
}

/* One group of weight rows (n0 .. n0 + cols - 1) against rows i0 .. i0 + M - 1 of x. */
NS_ALWAYS_INLINE void k_gemm_group(int t, const QuantizedRows *xq, const BlockWeight *w, float *out, int64_t ldo,
                                   int64_t i0, int64_t M, int64_t nb, int64_t n0, int64_t cols, KGroup u) {
    const int64_t ng = nb / 8, sets = (cols + SUB - 1) / SUB;
    k_unpack_group(t, w, n0, cols, nb, &u);
    NextGroupPrefetch next = next_group_prefetch(w, n0, cols, NGI, (M + TR - 1) / TR * sets);
    for (int64_t r0 = 0; r0 < M; r0 += TR) {
        const int8_t *qp = (K_PAIRED(t) ? xq->q_pairs : xq->q) + ((i0 + r0) / TR) * nb * TR * 32;
        const int64_t rows = M - r0 < TR ? M - r0 : TR;
        for (int64_t s = 0; s < sets; s += K_TILE_SETS(t)) {
            __m256 y[2][TR];
            const int ns = s + 1 < sets && K_TILE_SETS(t) == 2 ? 2 : 1;
            if (ns == 2) k_tile(t, 2, xq, qp, i0 + r0, nb, &u, s * ng, y);
            else k_tile(t, 1, xq, qp, i0 + r0, nb, &u, s * ng, y);
            for (int q = 0; q < ns && K_MIN_APART(t); q++) {
                __m256 m[TR];
                k_tile_min(t, xq, i0 + r0, nb, &u, (s + q) * ng, m);
                for (int r = 0; r < TR; r++) y[q][r] = _mm256_add_ps(y[q][r], m[r]);
            }
            for (int q = 0; q < ns; q++) prefetch_slice(&next); /* one slice per set, as next_group_prefetch counts */
            for (int q = 0; q < ns; q++) {
                const int64_t width = cols - (s + q) * SUB < SUB ? cols - (s + q) * SUB : SUB;
                for (int64_t r = 0; r < rows; r++) {
                    float *o = out + (i0 + r0 + r) * ldo + n0 + (s + q) * SUB;
                    if (width == SUB) _mm256_storeu_ps(o, y[q][r]);
                    else {
                        _Alignas(32) float tmp[SUB];
                        _mm256_store_ps(tmp, y[q][r]);
                        memcpy(o, tmp, sizeof(float) * (size_t)width);
                    }
                }
            }
        }
    }
}

/* Each weight row in parallel against the M <= STREAM_MAX_ROWS rows of x, quantized in one panel, the type
 * a literal in each region (see quantized_rows.h's STREAM_ROWS_CASE). */
void k_stream_i8(const QuantizedRows *xq, const BlockWeight *w, float *out, int64_t ldo, int64_t M) {
    const uint8_t *data = (const uint8_t *)w->data;
    const int64_t N = w->n, rb = w->row_bytes, nb = w->k / 32;
    switch (w->type) {
#define ROW(T, xq, rowp, o, ldo, m, nb) k_stream_row(T, xq, rowp, o, ldo, m, nb)
        STREAM_ROWS_CASE(T_Q2_K, ROW) STREAM_ROWS_CASE(T_Q3_K, ROW) STREAM_ROWS_CASE(T_Q4_K, ROW)
        STREAM_ROWS_CASE(T_Q5_K, ROW) STREAM_ROWS_CASE(T_Q6_K, ROW)
#undef ROW
    default: break;
    }
}

/* Each group of NGI weight rows in parallel against rows i0 .. i0 + M - 1 of x (TR-row panels). */
void k_gemm_i8(const QuantizedRows *xq, const BlockWeight *w, float *out, int64_t ldo, int64_t i0, int64_t M) {
    const int64_t N = w->n, nb = w->k / 32;
    const int64_t groups = (N + NGI - 1) / NGI;
#pragma omp parallel
    {
        KGroup u = {aligned_alloc(32, (size_t)(NGI * nb * 32)), aligned_alloc(32, sizeof(int16_t) * (size_t)(NGI * nb * 4)),
                    aligned_alloc(32, sizeof(float) * (size_t)(NGI * nb / 8)), aligned_alloc(32, sizeof(float) * (size_t)(NGI * nb / 8)),
                    aligned_alloc(32, sizeof(int16_t) * (size_t)(NGI * nb * 2))};
#pragma omp for GEMM_SCHEDULE
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * NGI, cols = N - n0 < NGI ? N - n0 : NGI;
            switch (w->type) {
            case T_Q2_K: k_gemm_group(T_Q2_K, xq, w, out, ldo, i0, M, nb, n0, cols, u); break;
            case T_Q3_K: k_gemm_group(T_Q3_K, xq, w, out, ldo, i0, M, nb, n0, cols, u); break;
            case T_Q4_K: k_gemm_group(T_Q4_K, xq, w, out, ldo, i0, M, nb, n0, cols, u); break;
            case T_Q5_K: k_gemm_group(T_Q5_K, xq, w, out, ldo, i0, M, nb, n0, cols, u); break;
            case T_Q6_K: k_gemm_group(T_Q6_K, xq, w, out, ldo, i0, M, nb, n0, cols, u); break;
            default: break;
            }
        }
        free(u.codes);
        free(u.sc);
        free(u.d);
        free(u.dmin);
        free(u.mn);
    }
}
