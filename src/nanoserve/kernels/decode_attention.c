/* Paged decode attention on the CPU: one query token per sequence attends to its whole context,
 * reading keys and values straight from the paged KV cache (no gathered copy). q and out are float32;
 * the cache is float32, or float16 (kv_f16, head_dim a multiple of 8), widened as it is read.
 * q: (B, H, D); k_cache, v_cache: (KVH, num_slots, D); slots: the cache slot of each position of row
 * b at slots + b * slot_stride (slot_stride 0: every row reads one list, as the rows of one prefill
 * sequence do); ctx_lens: (B,); out: (B, H, D). Heads of one KV group are consecutive (H = KVH * G).
 * Each (row, KV head) is one task computed in a fixed order, so a row's result does not depend on the
 * other rows. */
#include "simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

/* Lane i = the sum of the 8 lanes of v[i]: 8 dot products finished with 7 shuffles and adds. */
static inline __m256 sum8x8(const __m256 *v) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* How far ahead attend_vec asks for key and value rows: on caches in memory (bench kernels --attention),
 * 16 ran 263 us a layer, 32 291, 48 323. */
#define PREFETCH_ROWS 16
/* Value rows asked for ahead in the first pass over each 16 dims: bench kernels --attention 5-9% faster
 * on the SmolLM2 shape, 2-4% on TinyLlama's (asking in every pass, 4 x 3 of them there, was 5% slower). */
#define VALUE_PREFETCH_ROWS 8

/* 8 cache values at element offset i as floats: float32 as is, float16 widened (F16C). */
static inline __m256 load_kv(const void *base, int64_t i, int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + i)))
               : _mm256_loadu_ps((const float *)base + i);
}

static inline const char *kv_addr(const void *base, int64_t i, int f16) {
    return (const char *)base + i * (f16 ? 2 : 4);
}

/* Dot products of 4 key rows (element offsets krow[0..3]) with `heads` (1-3, a constant where inlined)
 * query heads q, q + D, q + 2D: up to 12 accumulators, 3 query vectors and 1 key vector, so each key
 * vector is loaded and widened once for all the heads. o_h[r] = head h, key r, 8 lanes still to sum. */
static inline __attribute__((always_inline)) void score_tile(
        const float *q, const void *kbase, const int64_t *krow, int64_t D, int heads,
        __m256 *o0, __m256 *o1, __m256 *o2, int f16) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m256 a13 = a00, a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 q0 = _mm256_loadu_ps(q + d);
        const __m256 q1 = heads > 1 ? _mm256_loadu_ps(q + D + d) : q0;
        const __m256 q2 = heads > 2 ? _mm256_loadu_ps(q + 2 * D + d) : q0;
#define SCORE_KEY(r, acc0, acc1, acc2) { const __m256 k = load_kv(kbase, krow[r] + d, f16); \
            acc0 = _mm256_fmadd_ps(q0, k, acc0); \
            if (heads > 1) acc1 = _mm256_fmadd_ps(q1, k, acc1); \
            if (heads > 2) acc2 = _mm256_fmadd_ps(q2, k, acc2); }
        SCORE_KEY(0, a00, a10, a20) SCORE_KEY(1, a01, a11, a21) SCORE_KEY(2, a02, a12, a22) SCORE_KEY(3, a03, a13, a23)
#undef SCORE_KEY
    }
    o0[0] = a00; o0[1] = a01; o0[2] = a02; o0[3] = a03;
    o1[0] = a10; o1[1] = a11; o1[2] = a12; o1[3] = a13;
    o2[0] = a20; o2[1] = a21; o2[2] = a22; o2[3] = a23;
}

/* Weighted sum of ctx value rows, dims d0 .. d0 + 8 nv - 1 (nv 1 or 2), for `heads` (1-3) heads whose
 * weights are the rows s0, s0 + ctx, s0 + 2 ctx: up to 6 accumulators, 3 weights, 1 value vector (16
 * dims, not 32: with 12 accumulators GCC spilled one to the stack, a store-load chain through every
 * row), stored at oh + h D + d0 (head h's dims d0 .. d0 + 8 nv - 1). The first pass over these dims (the
 * first 3 heads) asks for each row's part VALUE_PREFETCH_ROWS ahead: the rows prefetched while scoring
 * went to L2 only. */
static inline __attribute__((always_inline)) void value_tile(
        const float *s0, int64_t ctx, const void *vbase, const int64_t *seq_slots, int64_t D, int64_t d0,
        int heads, int nv, int first_pass, float *oh, int f16) {
    const float *s1 = s0 + (heads > 1 ? ctx : 0), *s2 = s0 + (heads > 2 ? 2 * ctx : 0);
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
    for (int64_t t = 0; t < ctx; t++) {
        const int64_t vrow = seq_slots[t] * D + d0;
        if (first_pass && t + VALUE_PREFETCH_ROWS < ctx)
            _mm_prefetch(kv_addr(vbase, seq_slots[t + VALUE_PREFETCH_ROWS] * D + d0, f16), _MM_HINT_T0);
        const __m256 p0 = _mm256_broadcast_ss(s0 + t), p1 = _mm256_broadcast_ss(s1 + t);
        const __m256 p2 = _mm256_broadcast_ss(s2 + t);
        __m256 v = load_kv(vbase, vrow, f16);
        a00 = _mm256_fmadd_ps(p0, v, a00);
        if (heads > 1) a10 = _mm256_fmadd_ps(p1, v, a10);
        if (heads > 2) a20 = _mm256_fmadd_ps(p2, v, a20);
        if (nv > 1) {
            v = load_kv(vbase, vrow + 8, f16);
            a01 = _mm256_fmadd_ps(p0, v, a01);
            if (heads > 1) a11 = _mm256_fmadd_ps(p1, v, a11);
            if (heads > 2) a21 = _mm256_fmadd_ps(p2, v, a21);
        }
    }
    /* stored here, where heads and nv are literals (returned in arrays for the caller to store, they were
     * copied with rep movsq: ~9% of the attention's samples at 32 rows) */
    _mm256_storeu_ps(oh + d0, a00);
    if (nv > 1) _mm256_storeu_ps(oh + d0 + 8, a01);
    if (heads > 1) _mm256_storeu_ps(oh + D + d0, a10);
    if (heads > 1 && nv > 1) _mm256_storeu_ps(oh + D + d0 + 8, a11);
    if (heads > 2) _mm256_storeu_ps(oh + 2 * D + d0, a20);
    if (heads > 2 && nv > 1) _mm256_storeu_ps(oh + 2 * D + d0 + 8, a21);
}

/* The 8 scores of keys t0 .. t0 + 7 (krow: their element offsets, past the context the first row's)
 * for query heads g .. g + heads - 1, scaled, into their rows of scores (G, ctx). */
static inline __attribute__((always_inline)) void score_heads(
        const float *qh, const void *kbase, const int64_t *krow, int64_t t0, int64_t ctx, int64_t g, int heads,
        int64_t D, float scale, float *scores, int f16) {
    __m256 acc[3][8];
    score_tile(qh + g * D, kbase, krow, D, heads, acc[0], acc[1], acc[2], f16);
    score_tile(qh + g * D, kbase, krow + 4, D, heads, acc[0] + 4, acc[1] + 4, acc[2] + 4, f16);
    for (int h = 0; h < heads; h++) {
        float dots[8];
        _mm256_storeu_ps(dots, _mm256_mul_ps(sum8x8(acc[h]), _mm256_set1_ps(scale)));
        for (int r = 0; r < 8 && t0 + r < ctx; r++) scores[(g + h) * ctx + t0 + r] = dots[r];
    }
}

/* s (n) <- softmax(s), 8 lanes at a time (fast_exp256; the last n % 8 with fast_expf), the sum as eight
 * lane sums then hsum256: ~10% of the attention's samples at 32 rows as a scalar loop. */
static inline void softmax_row(float *s, int64_t n) {
    const int64_t n8 = n / 8 * 8;
    float max_score = s[0];
    if (n8) {
        __m256 m = _mm256_loadu_ps(s);
        for (int64_t t = 8; t < n8; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
        _Alignas(32) float lanes[8];
        _mm256_store_ps(lanes, m);
        for (int l = 0; l < 8; l++) max_score = lanes[l] > max_score ? lanes[l] : max_score;
    }
    for (int64_t t = n8; t < n; t++) max_score = s[t] > max_score ? s[t] : max_score;
    const __m256 mv = _mm256_set1_ps(max_score);
    __m256 sv = _mm256_setzero_ps();
    for (int64_t t = 0; t < n8; t += 8) {
        const __m256 e = fast_exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum256(sv);
    for (int64_t t = n8; t < n; t++) {
        s[t] = fast_expf(s[t] - max_score);
        sum += s[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < n8; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(inv)));
    for (int64_t t = n8; t < n; t++) s[t] *= inv;
}

/* One (sequence, KV head) task with head_dim a multiple of 8, vectorized. Every key and value row is
 * read from memory once for all the query heads of its group: scores are computed 8 keys x 3 heads at
 * a time while those 8 rows sit in L1, and the output is accumulated for 3 heads x 16 dims while the
 * value rows stream past. Inlined into two copies, float32 and float16 cache (f16 a constant in each). */
static inline __attribute__((always_inline)) void attend_vec(
        const float *qh, const void *kbase, const void *vbase, const int64_t *seq_slots, int64_t ctx, int64_t group,
        int64_t D, float scale, float *scores, float *oh, int f16) {
    for (int64_t t = 0; t < PREFETCH_ROWS && t < ctx; t++) /* the first rows, all at once (2-3% faster) */
        for (int64_t d = 0; d < D; d += f16 ? 32 : 16) {
            _mm_prefetch(kv_addr(kbase, seq_slots[t] * D + d, f16), _MM_HINT_T0);
            _mm_prefetch(kv_addr(vbase, seq_slots[t] * D + d, f16), _MM_HINT_T1);
        }
    for (int64_t t0 = 0; t0 < ctx; t0 += 8) {
        int64_t krow[8]; /* element offsets of the 8 key rows; past the context the first row's (not stored) */
        for (int r = 0; r < 8; r++) krow[r] = seq_slots[t0 + r < ctx ? t0 + r : t0] * D;
        /* Cache blocks are pages of their own, where the hardware prefetcher stops: ask for the rows
         * PREFETCH_ROWS ahead, keys and values. */
        for (int64_t t = t0 + PREFETCH_ROWS; t < t0 + PREFETCH_ROWS + 8 && t < ctx; t++)
            for (int64_t d = 0; d < D; d += f16 ? 32 : 16) {
                _mm_prefetch(kv_addr(kbase, seq_slots[t] * D + d, f16), _MM_HINT_T0);
                _mm_prefetch(kv_addr(vbase, seq_slots[t] * D + d, f16), _MM_HINT_T1);
            }
        int64_t g = 0;
        for (; g + 3 <= group; g += 3) score_heads(qh, kbase, krow, t0, ctx, g, 3, D, scale, scores, f16);
        if (group - g == 2) score_heads(qh, kbase, krow, t0, ctx, g, 2, D, scale, scores, f16);
        if (group - g == 1) score_heads(qh, kbase, krow, t0, ctx, g, 1, D, scale, scores, f16);
    }
    for (int64_t g = 0; g < group; g++) softmax_row(scores + g * ctx, ctx);
    for (int64_t g0 = 0; g0 < group; g0 += 3) {
        const int heads = group - g0 < 3 ? (int)(group - g0) : 3;
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
            const int nv = D - d0 < 16 ? 1 : 2;
            const float *s0 = scores + g0 * ctx;
            float *o = oh + g0 * D;
            const int first = g0 == 0;
            if (heads == 3 && nv == 2) value_tile(s0, ctx, vbase, seq_slots, D, d0, 3, 2, first, o, f16);
            else if (heads == 3) value_tile(s0, ctx, vbase, seq_slots, D, d0, 3, 1, first, o, f16);
            else if (heads == 2 && nv == 2) value_tile(s0, ctx, vbase, seq_slots, D, d0, 2, 2, first, o, f16);
            else if (heads == 2) value_tile(s0, ctx, vbase, seq_slots, D, d0, 2, 1, first, o, f16);
            else if (nv == 2) value_tile(s0, ctx, vbase, seq_slots, D, d0, 1, 2, first, o, f16);
            else value_tile(s0, ctx, vbase, seq_slots, D, d0, 1, 1, first, o, f16);
        }
    }
}

void decode_attention_f32(const float *q, const void *k_cache_any, const void *v_cache_any,
                          const int64_t *slots, const int64_t *ctx_lens, float *out,
                          int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t num_slots, int64_t slot_stride, int64_t kv_f16, float scale) {
    const float *k_cache = k_cache_any, *v_cache = v_cache_any; /* the scalar path: float32 only */
    const int64_t group = num_heads / num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < batch * num_kv_heads; task++) {
        const int64_t b = task / num_kv_heads, kvh = task % num_kv_heads;
        const int64_t ctx = ctx_lens[b];
        const int64_t *seq_slots = slots + b * slot_stride;
        const float *kbase = k_cache + kvh * num_slots * head_dim;
        const float *vbase = v_cache + kvh * num_slots * head_dim;
        float *scores = malloc(sizeof(float) * group * ctx);  /* (G, ctx) */
        const float *qh = q + (b * num_heads + kvh * group) * head_dim;  /* (G, D) */
        if (head_dim % 8 == 0) {
            float *oh = out + (b * num_heads + kvh * group) * head_dim;
            const int64_t head_off = kvh * num_slots * head_dim;
            if (kv_f16)
                attend_vec(qh, (const uint16_t *)k_cache_any + head_off, (const uint16_t *)v_cache_any + head_off,
                           seq_slots, ctx, group, head_dim, scale, scores, oh, 1);
            else
                attend_vec(qh, kbase, vbase, seq_slots, ctx, group, head_dim, scale, scores, oh, 0);
            free(scores);
            continue;
        }
        /* Each key row is read once and scored against every query head of its group. */
        for (int64_t t = 0; t < ctx; t++) {
            const float *krow = kbase + seq_slots[t] * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qh + g * head_dim;
                float dot = 0.f;
                for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * krow[d];
                scores[g * ctx + t] = dot * scale;
            }
        }
        for (int64_t g = 0; g < group; g++) {  /* softmax of each head's row */
            float *s = scores + g * ctx;
            float max_score = s[0];
            for (int64_t t = 1; t < ctx; t++) if (s[t] > max_score) max_score = s[t];
            float sum = 0.f;
            for (int64_t t = 0; t < ctx; t++) { s[t] = expf(s[t] - max_score); sum += s[t]; }
            const float inv = 1.f / sum;
            for (int64_t t = 0; t < ctx; t++) s[t] *= inv;
        }
        float *oh = out + (b * num_heads + kvh * group) * head_dim;  /* (G, D) */
        memset(oh, 0, sizeof(float) * group * head_dim);
        for (int64_t t = 0; t < ctx; t++) {  /* each value row is read once as well */
            const float *vrow = vbase + seq_slots[t] * head_dim;
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * ctx + t];
                float *og = oh + g * head_dim;
                for (int64_t d = 0; d < head_dim; d++) og[d] += p * vrow[d];
            }
        }
        free(scores);
    }
}
