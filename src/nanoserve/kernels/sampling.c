/* The sampler's whole chain for a batch, one row per OpenMP task: logits processors (allowed tokens,
 * banned tokens, logit_bias, repetition / frequency / presence penalties), then greedy argmax or
 * temperature, min_p, top-k (a k-sized heap), top-p (a sort of the few tokens that can matter) and the
 * exponential race argmax(p_i / q_i), q_i = -log(u_i), done in log space as argmax(x_i - log q_i).
 * u_i is a counter-based hash of the row's 64-bit key and the token id, so a row's draws depend only on
 * its key (from its seed and output position), never on the batch around it. */
#include "simd.h"
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "abi.h"
#include "vec_math.h"

static inline uint32_t mix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

/* Uniform in (0, 1) with 23 random bits (never 0 or 1): the same numbers as `noise_uniform` in
 * sampler.py, which the PyTorch fallback uses. */
static inline float noise_uniform(uint32_t k0, uint32_t k1, uint32_t token) {
    uint32_t h = mix32(mix32(token * 0x9e3779b9u + k0) ^ k1);
    return ((float)(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
}

static inline float gumbel_key(float x, uint32_t k0, uint32_t k1, uint32_t token) {
    return x - fast_logf(-fast_logf(noise_uniform(k0, k1, token)));
}

typedef struct { float v; int32_t i; } Entry;

/* One entrant of the race: token id with value x. The highest key wins; ties go to the lower token
 * id, as a scan in order would. */
static inline void race_enter(float x, int64_t id, uint32_t k0, uint32_t k1, float *best, int64_t *won) {
    const float g = gumbel_key(x, k0, k1, (uint32_t)id);
    if (g > *best || (g == *best && id < *won)) { *best = g; *won = id; }
}

static inline float max8(__m256 v) {
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, v);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    return m;
}

static float row_max(const float *x, int64_t n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
    float m = max8(mv);
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* The first index of the value m (the row's maximum), 0 if absent (every value -inf). */
static int64_t first_index_of(const float *x, int64_t n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0;
}

/* The first index of the maximum, as torch.argmax. */
static int64_t argmax(const float *x, int64_t n) { return first_index_of(x, n, row_max(x, n)); }

/* Gumbel keys are at most GUMBEL_MAX (-log(-log(1 - 2^-24)) = 16.64, plus slack for fast_logf), so a
 * token whose logit is more than that below some token's key can never win the race: the race only
 * computes keys where they can matter, and still picks exactly the token a full pass would. */
#define GUMBEL_MAX 16.75f

/* For each 8-bit mask, the lane numbers of its set bits, lowest first, one byte each: the permutation
 * that packs the selected lanes of a vector to its front. */
static uint64_t pack_lut[256];

__attribute__((constructor)) static void build_pack_lut(void) {
    for (int mask = 0; mask < 256; mask++) {
        uint64_t lanes = 0;
        int n = 0;
        for (int lane = 0; lane < 8; lane++)
            if (mask & (1 << lane)) lanes |= (uint64_t)lane << (8 * n++);
        pack_lut[mask] = lanes;
    }
}

static inline __m256i mix32_v(__m256i h) {
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0x85ebca6bu));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32((int)0xc2b2ae35u));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

/* A token whose logit is d below the best key so far wins only if its Gumbel noise -log(-log u) exceeds
 * d, i.e. only if u > exp(-exp(-d)). For d of at least RACE_TIER_D[j], u (as its 23-bit integer h >> 9)
 * below RACE_TIER_U[j] = floor(exp(-exp(-(d - 0.02))) * 2^23) - 1 rules the token out without a log:
 * 0.02 of margin covers fast_logf's error many times over. */
static const float RACE_TIER_D[] = {1.0f, 2.0f, 3.0f, 4.0f, 6.0f, 9.0f, 12.0f};
static const int32_t RACE_TIER_U[] = {5763606, 7306798, 7973165, 8233315, 8367420, 8387550, 8388554};

/* The race over a whole row (max m). Tokens above the floor (more than GUMBEL_MAX below the top token's
 * key they cannot win) are packed (ids and values) into the scratch arrays; then each block of 8 gets
 * its noise as integers, and keys (two logs each) are computed only for tokens whose noise is large
 * enough to beat the best key so far. */
static int64_t race_all(const float *x, int64_t n, float m, uint32_t k0, uint32_t k1, int32_t *ids, float *vals) {
    const int64_t top = first_index_of(x, n, m);
    float best = gumbel_key(x[top], k0, k1, (uint32_t)top);
    int64_t won = top;
    const __m256 fv = _mm256_set1_ps(best - GUMBEL_MAX);
    __m256i iv = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i step = _mm256_set1_epi32(8);
    int64_t live = 0, i = 0;
    for (; i + 8 <= n; i += 8, iv = _mm256_add_epi32(iv, step)) { /* branch-free left-pack */
        const __m256 v = _mm256_loadu_ps(x + i);
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(v, fv, _CMP_GT_OQ));
        const __m256i perm = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)&pack_lut[hit]));
        _mm256_storeu_si256((__m256i *)(ids + live), _mm256_permutevar8x32_epi32(iv, perm));
        _mm256_storeu_ps(vals + live, _mm256_permutevar8x32_ps(v, perm));
        live += __builtin_popcount((unsigned)hit);
    }
    for (; i < n; i++)
        if (x[i] > best - GUMBEL_MAX) { ids[live] = (int32_t)i; vals[live++] = x[i]; }
    const __m256i key0 = _mm256_set1_epi32((int)k0), key1 = _mm256_set1_epi32((int)k1);
    const __m256i golden = _mm256_set1_epi32((int)0x9e3779b9u);
    int64_t j = 0;
    for (; j + 8 <= live; j += 8) {
        const __m256i tok = _mm256_loadu_si256((const __m256i *)(ids + j));
        const __m256i h = mix32_v(_mm256_xor_si256(mix32_v(_mm256_add_epi32(_mm256_mullo_epi32(tok, golden), key0)),
                                                   key1));
        const __m256i u = _mm256_srli_epi32(h, 9);
        const __m256 d = _mm256_sub_ps(_mm256_set1_ps(best), _mm256_loadu_ps(vals + j));
        __m256i need = _mm256_setzero_si256(); /* the smallest u that could still win */
        for (int t = 0; t < 7; t++) {
            const __m256 far = _mm256_cmp_ps(d, _mm256_set1_ps(RACE_TIER_D[t]), _CMP_GE_OQ);
            need = _mm256_blendv_epi8(need, _mm256_set1_epi32(RACE_TIER_U[t]), _mm256_castps_si256(far));
        }
        unsigned hit = ~(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(need, u))) & 0xffu;
        for (; hit; hit &= hit - 1) {
            const int64_t l = j + __builtin_ctz(hit);
            race_enter(vals[l], ids[l], k0, k1, &best, &won);
        }
    }
    for (; j < live; j++) race_enter(vals[j], ids[j], k0, k1, &best, &won);
    return won;
}

/* The race among kept candidates only (top-k / top-p / min_p rows). */
static int64_t race_candidates(const Entry *cand, int64_t nc, uint32_t k0, uint32_t k1) {
    float best = -INFINITY;
    int64_t won = cand[0].i;
    for (int64_t j = 0; j < nc; j++) race_enter(cand[j].v, cand[j].i, k0, k1, &best, &won);
    return won;
}

static inline void heap_push(float *heap, int64_t *size, int64_t k, float v) {
    int64_t j;
    if (*size < k) { /* sift up */
        j = (*size)++;
        while (j > 0 && heap[(j - 1) / 2] > v) { heap[j] = heap[(j - 1) / 2]; j = (j - 1) / 2; }
        heap[j] = v;
        return;
    }
    if (!(v > heap[0])) return;
    j = 0; /* replace the minimum, sift down */
    for (;;) {
        int64_t c = 2 * j + 1;
        if (c >= k) break;
        if (c + 1 < k && heap[c + 1] < heap[c]) c++;
        if (!(heap[c] < v)) break;
        heap[j] = heap[c];
        j = c;
    }
    heap[j] = v;
}

/* The k-th largest of x (counting repeats) with a k-sized min-heap; once it is full, blocks of 8 with
 * nothing above its minimum are skipped with one comparison, so this is one pass for the small k
 * clients use. */
static float kth_largest(const float *x, int64_t n, int64_t k, float *heap) {
    int64_t size = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        if (size == k && !_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(heap[0]),
                                                             _CMP_GT_OQ)))
            continue;
        for (int64_t j = i; j < i + 8; j++) heap_push(heap, &size, k, x[j]);
    }
    for (; i < n; i++) heap_push(heap, &size, k, x[i]);
    return heap[0];
}

/* Appends to cand the tokens with x >= lo (lo > -inf) and returns their count; when mass is given,
 * adds exp(x - m) of each to it. */
static int64_t collect(const float *x, int64_t n, float lo, float m, Entry *cand, double *mass) {
    const __m256 lv = _mm256_set1_ps(lo);
    int64_t nc = 0, i = 0;
    for (; i + 8 <= n; i += 8) {
        unsigned hit = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), lv, _CMP_GE_OQ));
        for (; hit; hit &= hit - 1) {
            int64_t t = i + __builtin_ctz(hit);
            cand[nc].v = x[t];
            cand[nc++].i = (int32_t)t;
        }
    }
    for (; i < n; i++)
        if (x[i] >= lo) { cand[nc].v = x[i]; cand[nc++].i = (int32_t)i; }
    if (mass) {
        double s = 0.0;
        for (int64_t j = 0; j < nc; j++) s += fast_expf(cand[j].v - m);
        *mass += s;
    }
    return nc;
}

/* "a ranks before b": higher value, then lower token id (the order of a stable descending sort). */
static inline int before(Entry a, Entry b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

static void sift_down(Entry *h, int64_t n, int64_t j) {
    const Entry e = h[j];
    for (;;) {
        int64_t c = 2 * j + 1;
        if (c >= n) break;
        if (c + 1 < n && before(h[c + 1], h[c])) c++;
        if (!before(h[c], e)) break;
        h[j] = h[c];
        j = c;
    }
    h[j] = e;
}

/* The sum of exp(x_i - m) over the x_i >= lo (the softmax normaliser for top-p). */
static float sum_exp_from(const float *x, int64_t n, float lo, float m) {
    const __m256 lv = _mm256_set1_ps(lo), mv = _mm256_set1_ps(m);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) { /* two accumulators: the adds do not wait on each other */
        const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
        const __m256 e0 = fast_exp256(_mm256_sub_ps(v0, mv)), e1 = fast_exp256(_mm256_sub_ps(v1, mv));
        acc0 = _mm256_add_ps(acc0, _mm256_and_ps(_mm256_cmp_ps(v0, lv, _CMP_GE_OQ), e0));
        acc1 = _mm256_add_ps(acc1, _mm256_and_ps(_mm256_cmp_ps(v1, lv, _CMP_GE_OQ), e1));
    }
    float sum = hsum256(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++) sum += x[i] >= lo ? fast_expf(x[i] - m) : 0.0f;
    return sum;
}

/* Fills cand with the tokens that survive top-p among those with x >= lo (max m), and returns their
 * count: tokens are kept in rank order while the probability of the tokens ranked above them is below
 * p, the first always. Only tokens within `cut` of the max are looked at; the cut widens until they
 * hold at least p of the mass. They are ranked with a heap, popping only as many as top-p keeps.
 * z_known: the normaliser (sum of exp(x_i - m) over x_i >= lo) when already computed, else -1. */
static int64_t top_p_keep(const float *x, int64_t n, float m, float lo, float p, Entry *cand, float z_known) {
    const float cuts[] = {10.0f, 25.0f, INFINITY};
    double z = z_known, mass = 0.0;
    int64_t nc = 0;
    for (int c = 0; c < 3; c++) {
        mass = 0.0;
        nc = collect(x, n, fmaxf(lo, m - cuts[c]), m, cand, &mass);
        if (z < 0.0) { /* the normaliser: the first cut's own mass when it does not bind */
            if (lo >= m - cuts[c]) {
                z = mass;
            } else {
                z = sum_exp_from(x, n, lo, m);
            }
        }
        if (mass >= p * z) break;
    }
    for (int64_t j = nc / 2 - 1; j >= 0; j--) sift_down(cand, nc, j);
    double above = 0.0, limit = (double)p * z;
    int64_t nk = 0, left = nc;
    while (left > 0 && (nk == 0 || above < limit)) { /* pop the best to the end of the array */
        Entry best = cand[0];
        cand[0] = cand[--left];
        sift_down(cand, left, 0);
        cand[left] = best;
        above += fast_expf(best.v - m);
        nk++;
    }
    memmove(cand, cand + left, sizeof(Entry) * (size_t)nk);
    return nk;
}

/* x[i] = src[i] / t; returns the row's max. */
static float scale_max(float *x, const float *src, int64_t n, float t) {
    const __m256 tv = _mm256_set1_ps(t);
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    if (t == 1.0f) { /* x / 1 == x: a copy */
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_loadu_ps(src + i);
            _mm256_storeu_ps(x + i, v);
            mv = _mm256_max_ps(mv, v);
        }
    } else {
        for (; i + 8 <= n; i += 8) {
            __m256 v = _mm256_div_ps(_mm256_loadu_ps(src + i), tv);
            _mm256_storeu_ps(x + i, v);
            mv = _mm256_max_ps(mv, v);
        }
    }
    float m = max8(mv);
    for (; i < n; i++) {
        x[i] = src[i] / t;
        m = x[i] > m ? x[i] : m;
    }
    return m;
}

/* x[i] = src[i] / t, returning the max m, and *z = the sum of exp(x_i - m), in one pass: each lane keeps
 * its own running max and rescales its sum when that max grows, so the exps overlap the loads instead
 * of taking a second pass (top-p rows without top-k or min_p need the whole normaliser). */
static float scale_max_sumexp(float *x, const float *src, int64_t n, float t, float *z) {
    const __m256 tv = _mm256_set1_ps(t);
    __m256 mv = _mm256_set1_ps(-INFINITY), sv = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_div_ps(_mm256_loadu_ps(src + i), tv);
        _mm256_storeu_ps(x + i, v);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, mv, _CMP_GT_OQ))) { /* rare once the row's top is seen */
            const __m256 grown = _mm256_max_ps(mv, v);
            sv = _mm256_mul_ps(sv, fast_exp256(_mm256_sub_ps(mv, grown))); /* -inf - finite: exp 0 */
            mv = grown;
        }
        sv = _mm256_add_ps(sv, fast_exp256(_mm256_sub_ps(v, mv)));
    }
    float m = max8(mv);
    for (int64_t j = i; j < n; j++) {
        x[j] = src[j] / t;
        m = x[j] > m ? x[j] : m;
    }
    float lanes_m[8], lanes_s[8], sum = 0.0f;
    _mm256_storeu_ps(lanes_m, mv);
    _mm256_storeu_ps(lanes_s, sv);
    for (int l = 0; l < 8; l++) sum += lanes_s[l] > 0.0f ? lanes_s[l] * fast_expf(lanes_m[l] - m) : 0.0f;
    for (; i < n; i++) sum += fast_expf(x[i] - m);
    *z = sum;
    return m;
}

/* Whether token i is allowed by a packed mask (abi.h: bit i % 32 of word i / 32). */
static inline int allowed_bit(const uint32_t *mask, int64_t i) { return (int)((mask[i >> 5] >> (i & 31)) & 1u); }

/* x[i] = (allowed_bit(mask, i) ? src[i] : -inf) / t (allowed_token_ids and grammars); returns the row's max. */
static float mask_scale_max(float *x, const float *src, const uint32_t *mask, int64_t n, float t) {
    const __m256 tv = _mm256_set1_ps(t), ninf = _mm256_set1_ps(-INFINITY);
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    __m256 mv = ninf;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) { /* i is a multiple of 8: its 8 bits are in one word */
        const uint32_t bits = (mask[i >> 5] >> (i & 31)) & 0xFFu;
        if (bits == 0) {
            _mm256_storeu_ps(x + i, ninf);
            continue;
        }
        const __m256i on = _mm256_and_si256(_mm256_set1_epi32((int32_t)bits), lane_bit);
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(on, _mm256_setzero_si256()));
        const __m256 v = _mm256_blendv_ps(ninf, _mm256_div_ps(_mm256_loadu_ps(src + i), tv), keep);
        _mm256_storeu_ps(x + i, v);
        mv = _mm256_max_ps(mv, v);
    }
    float m = max8(mv);
    for (; i < n; i++) {
        x[i] = allowed_bit(mask, i) ? src[i] / t : -INFINITY;
        m = x[i] > m ? x[i] : m;
    }
    return m;
}

/* The processors that touch few tokens, on a row x already masked and divided by t (max m): banned
 * tokens, logit_bias, and the penalties, which change only the tokens seen in the prompt or output
 * (the row's list `seen`, n_seen long). Each touched token's value is rebuilt from src in vLLM's order
 * (allowed -> banned -> bias -> penalties) in the scratch y, then divided by t into x: the same numbers
 * a dense pass would give, without one. Returns the row's new max. */
static float apply_sparse(float *x, float *y, const float *src, int64_t V, const uint32_t *mask, float t, float m,
                          const int64_t *ban, int64_t n_ban, const int64_t *bias_tok, const float *bias_val,
                          int64_t n_bias, const int32_t *seen, int64_t n_seen, const int32_t *counts,
                          float rep, float freq, float pres) {
    int recheck = 0; /* a touched token held the max: it may have gone down */
#define TOUCHED(body)                                                     \
    for (int64_t j = 0; j < n_ban; j++) { const int64_t tok = ban[j]; body; }       \
    for (int64_t j = 0; j < n_bias; j++) { const int64_t tok = bias_tok[j]; body; } \
    for (int64_t j = 0; j < n_seen; j++) { const int64_t tok = seen[j]; body; }
    TOUCHED(recheck |= x[tok] == m; y[tok] = mask && !allowed_bit(mask, tok) ? -INFINITY : src[tok])
    for (int64_t j = 0; j < n_ban; j++) y[ban[j]] = -INFINITY;
    for (int64_t j = 0; j < n_bias; j++) y[bias_tok[j]] += bias_val[j];
    for (int64_t j = 0; j < n_seen; j++) { /* the dense formula's seen branch; unseen tokens keep v */
        const int64_t tok = seen[j];
        const float v = y[tok], c = (float)counts[tok];
        y[tok] = (v > 0 ? v / rep : v * rep) - freq * c - pres * (float)(counts[tok] > 0);
    }
    float mx = m;
    TOUCHED(x[tok] = y[tok] / t; mx = x[tok] > mx ? x[tok] : mx)
#undef TOUCHED
    return recheck ? row_max(x, V) : mx;
}

/* The chain over a batch (abi.h's SampleArgs). When write_work, work (B, V) receives each row's
 * processed logits (greedy rows: after the processors only; others also divided by their temperature,
 * dropped tokens at -inf); otherwise it is not touched and each row works in a per-thread buffer that
 * stays in cache. */
void sample_rows(const SampleArgs *a) {
    const float *logits = a->logits, *temperature = a->temperature, *min_p = a->min_p, *top_p = a->top_p;
    const float *bias_values = a->bias_values, *repetition = a->repetition, *frequency = a->frequency;
    const float *presence = a->presence;
    const int64_t *top_k = a->top_k, *keys = a->keys, *allowed_row = a->allowed_row, *ban_offsets = a->ban_offsets;
    const int64_t *ban_tokens = a->ban_tokens, *bias_offsets = a->bias_offsets, *bias_tokens = a->bias_tokens;
    const int64_t *num_seen = a->num_seen, *penalty_row = a->penalty_row;
    const int32_t *seen_tokens = a->seen_tokens, *output_counts = a->output_counts;
    const uint32_t *allowed = a->allowed;
    const int64_t write_work = a->write_work, B = a->batch, V = a->vocab, seen_stride = a->seen_stride;
    const int64_t mask_words = (V + 31) / 32;
    float *work = a->work;
    int64_t *tokens = a->tokens;
#pragma omp parallel
    {
        /* Per-thread scratch: the row, candidates for top-k / top-p, the heap for top-k (also the race's
         * packed values and the sparse processors' values). */
        float *row = malloc(sizeof(float) * (size_t)V);
        Entry *cand = malloc(sizeof(Entry) * (size_t)V);
        float *heap = malloc(sizeof(float) * (size_t)(V + 8));
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            float *x = write_work ? work + b * V : row;
            const float *src = logits + b * V;
            const float t = temperature[b], ts = t == 0.0f ? 1.0f : t; /* greedy rows: x / 1 == x */
            const uint32_t *mask = allowed_row[b] >= 0 ? allowed + allowed_row[b] * mask_words : NULL;
            const int64_t pr = penalty_row[b], n_ban = ban_offsets[b + 1] - ban_offsets[b],
                          n_bias = bias_offsets[b + 1] - bias_offsets[b];
            const int sparse = pr >= 0 || n_ban > 0 || n_bias > 0;
            if (t == 0.0f && !mask && !sparse) {
                if (write_work) memcpy(x, src, sizeof(float) * (size_t)V);
                tokens[b] = argmax(src, V);
                continue;
            }
            /* A top-p row with nothing else to cut it needs the normaliser over every token: computed
             * in the pass that scales the row. */
            const int whole_top_p = t != 0.0f && top_p[b] < 1.0f && top_k[b] >= V && !(min_p[b] > 0.0f)
                                    && !mask && !sparse;
            float z = -1.0f;
            float m = mask ? mask_scale_max(x, src, mask, V, ts)
                      : whole_top_p ? scale_max_sumexp(x, src, V, ts, &z) : scale_max(x, src, V, ts);
            if (sparse)
                m = apply_sparse(x, heap, src, V, mask, ts, m, ban_tokens + ban_offsets[b], n_ban,
                                 bias_tokens + bias_offsets[b], bias_values + bias_offsets[b], n_bias,
                                 pr >= 0 ? seen_tokens + pr * seen_stride : NULL, pr >= 0 ? num_seen[pr] : 0,
                                 pr >= 0 ? output_counts + pr * V : NULL, pr >= 0 ? repetition[b] : 1.0f,
                                 pr >= 0 ? frequency[b] : 0.0f, pr >= 0 ? presence[b] : 0.0f);
            if (t == 0.0f) {
                tokens[b] = first_index_of(x, V, m);
                continue;
            }
            if (!(m > -INFINITY)) { /* every token banned: nothing to draw from */
                tokens[b] = 0;
                continue;
            }
            /* min_p and top-k are thresholds: p_i < min_p * p_max <=> x_i < m + log(min_p), and the
             * k-th largest of what min_p left is the k-th largest overall unless that is below it. */
            float lo = -INFINITY;
            if (min_p[b] > 0.0f) lo = m + logf(min_p[b]);
            if (top_k[b] < V) lo = fmaxf(lo, kth_largest(x, V, top_k[b], heap));
            const uint32_t k0 = (uint32_t)keys[2 * b], k1 = (uint32_t)keys[2 * b + 1];
            int64_t nk = -1; /* kept candidates, or -1: threshold rows keep everything >= lo */
            if (top_p[b] < 1.0f) {
                nk = top_p_keep(x, V, m, fmaxf(lo, -FLT_MAX), top_p[b], cand, z);
                tokens[b] = race_candidates(cand, nk, k0, k1);
            } else if (lo > -INFINITY) {
                tokens[b] = race_candidates(cand, collect(x, V, lo, m, cand, NULL), k0, k1);
            } else {
                tokens[b] = race_all(x, V, m, k0, k1, (int32_t *)cand, heap);
            }
            if (!write_work) continue;
            if (nk >= 0) { /* drop everything, then put the kept values back */
                for (int64_t i = 0; i < V; i++) x[i] = -INFINITY;
                for (int64_t j = 0; j < nk; j++) x[cand[j].i] = cand[j].v;
            } else if (lo > -INFINITY) {
                for (int64_t i = 0; i < V; i++) x[i] = x[i] < lo ? -INFINITY : x[i];
            }
        }
        free(row);
        free(cand);
        free(heap);
    }
}
