/* The sampler's whole chain for a batch, one row per OpenMP task: logits processors (allowed tokens,
 * banned tokens, logit_bias, repetition / frequency / presence penalties), then greedy argmax or
 * temperature, min_p, top-k (a k-sized heap), top-p (a sort of the few tokens that can matter) and the
 * exponential race argmax(p_i / q_i), q_i = -log(u_i), done in log space as argmax(x_i - log q_i).
 * u_i is a counter-based hash of the row's 64-bit key and the token id, so a row's draws depend only on
 * its key (from its seed and output position), never on the batch around it. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

static int by_value_desc(const void *a, const void *b) {
    const Entry *x = a, *y = b;
    if (x->v != y->v) return x->v < y->v ? 1 : -1;
    return x->i - y->i;
}

static float row_max(const float *x, int64_t n) {
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(x + i));
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, mv);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* The first index of the maximum (as torch.argmax); 0 when every value is -inf. */
static int64_t argmax(const float *x, int64_t n) {
    const float m = row_max(x, n);
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

/* Gumbel keys are at most GUMBEL_MAX (-log(-log(1 - 2^-24)) = 16.64, plus slack for fast_logf), so a
 * token whose logit is more than that below some token's key can never win the race: the race only
 * computes keys for the others, and still picks exactly the token a full pass would. */
#define GUMBEL_MAX 16.75f

static int64_t race(const float *x, int64_t n, uint32_t k0, uint32_t k1, int32_t *idx, float *keys) {
    const int64_t top = argmax(x, n);
    const float floor = gumbel_key(x[top], k0, k1, (uint32_t)top) - GUMBEL_MAX;
    int64_t live = 0;
    for (int64_t i = 0; i < n; i++) { /* branch-free compaction */
        idx[live] = (int32_t)i;
        live += x[i] > floor;
    }
    for (int64_t j = 0; j < live; j++) keys[j] = gumbel_key(x[idx[j]], k0, k1, (uint32_t)idx[j]);
    return idx[argmax(keys, live)];
}

/* The k-th largest of x (counting repeats) with a k-sized min-heap: most values fail the first
 * comparison, so this is one pass for the small k clients use. */
static float kth_largest(const float *x, int64_t n, int64_t k, float *heap) {
    int64_t size = 0;
    for (int64_t i = 0; i < n; i++) {
        float v = x[i];
        if (size == k && !(v > heap[0])) continue;
        int64_t j;
        if (size < k) { /* sift up */
            j = size++;
            while (j > 0 && heap[(j - 1) / 2] > v) { heap[j] = heap[(j - 1) / 2]; j = (j - 1) / 2; }
            heap[j] = v;
            continue;
        }
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
    return heap[0];
}

/* top-p over the finite values of x (max m): keeps tokens in descending order while the probability
 * of the tokens ranked above them is below p, the first always. Only tokens within `cut` of the max
 * are sorted; the cut widens until they hold at least p of the mass. */
static void top_p_keep(float *x, int64_t n, float m, float p, Entry *cand) {
    float z = 0.0f;
    for (int64_t i = 0; i < n; i++) z += fast_expf(x[i] - m); /* exp(-inf) = 0 */
    const float cuts[] = {10.0f, 25.0f, INFINITY};
    int64_t nc = 0;
    for (int c = 0; c < 3; c++) {
        float lo = m - cuts[c];
        double mass = 0.0;
        nc = 0;
        for (int64_t i = 0; i < n; i++)
            if (x[i] >= lo && x[i] > -INFINITY) {
                cand[nc].v = x[i];
                cand[nc++].i = (int32_t)i;
                mass += fast_expf(x[i] - m);
            }
        if (mass >= p * z) break;
    }
    qsort(cand, (size_t)nc, sizeof(Entry), by_value_desc);
    double above = 0.0, limit = (double)p * z;
    int64_t nk = 0;
    for (; nk < nc; nk++) {
        if (nk > 0 && !(above < limit)) break;
        above += fast_expf(cand[nk].v - m);
    }
    /* Drop everything, then put the kept values back. */
    for (int64_t i = 0; i < n; i++) x[i] = -INFINITY;
    for (int64_t j = 0; j < nk; j++) x[cand[j].i] = cand[j].v;
}

static void apply_processors(float *x, int64_t b, int64_t V, const uint8_t *allowed, const int64_t *allowed_row,
                             const int64_t *ban_offsets, const int64_t *ban_tokens, const int64_t *bias_offsets,
                             const int64_t *bias_tokens, const float *bias_values, const uint8_t *prompt_mask,
                             const int32_t *output_counts, const int64_t *penalty_row, const float *repetition,
                             const float *frequency, const float *presence) {
    if (allowed_row[b] >= 0) {
        const uint8_t *mask = allowed + allowed_row[b] * V;
        for (int64_t i = 0; i < V; i++) x[i] = mask[i] ? x[i] : -INFINITY;
    }
    for (int64_t j = ban_offsets[b]; j < ban_offsets[b + 1]; j++) x[ban_tokens[j]] = -INFINITY;
    for (int64_t j = bias_offsets[b]; j < bias_offsets[b + 1]; j++) x[bias_tokens[j]] += bias_values[j];
    if (penalty_row[b] >= 0) {
        const uint8_t *pm = prompt_mask + penalty_row[b] * V;
        const int32_t *counts = output_counts + penalty_row[b] * V;
        const float rep = repetition[b], freq = frequency[b], pres = presence[b];
        for (int64_t i = 0; i < V; i++) {
            float v = x[i], c = (float)counts[i];
            if (pm[i] || counts[i] > 0) v = v > 0 ? v / rep : v * rep;
            v = v - freq * c;
            x[i] = v - pres * (float)(counts[i] > 0);
        }
    }
}

/* logits, work: (B, V) float32; work receives each row's processed logits (greedy rows: after the
 * processors only; others also divided by their temperature, dropped tokens at -inf). Per row:
 * temperature (0 = greedy), min_p (0 = off), top_k (>= V = off), top_p (1 = off), keys (B, 2) uint32
 * in int64. allowed_row, penalty_row: -1 or a row of `allowed` (A, V) / the penalty tensors;
 * bans and biases as CSR lists (offsets of length B + 1). */
void sample_rows(const float *logits, float *work, int64_t B, int64_t V, const float *temperature,
                 const float *min_p, const int64_t *top_k, const float *top_p, const int64_t *keys,
                 const uint8_t *allowed, const int64_t *allowed_row, const int64_t *ban_offsets,
                 const int64_t *ban_tokens, const int64_t *bias_offsets, const int64_t *bias_tokens,
                 const float *bias_values, const uint8_t *prompt_mask, const int32_t *output_counts,
                 const int64_t *penalty_row, const float *repetition, const float *frequency,
                 const float *presence, int64_t *tokens) {
#pragma omp parallel
    {
        /* Per-thread scratch: candidates for top-p, the heap for top-k, the race's live tokens. */
        Entry *cand = malloc(sizeof(Entry) * (size_t)V);
        float *scratch = malloc(sizeof(float) * (size_t)V);
        int32_t *idx = malloc(sizeof(int32_t) * (size_t)V);
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            float *x = work + b * V;
            const float *raw = logits + b * V;
            const float t = temperature[b];
            const int processed = allowed_row[b] >= 0 || penalty_row[b] >= 0 || ban_offsets[b + 1] > ban_offsets[b]
                                  || bias_offsets[b + 1] > bias_offsets[b];
            if (processed) {
                memcpy(x, raw, sizeof(float) * (size_t)V);
                apply_processors(x, b, V, allowed, allowed_row, ban_offsets, ban_tokens, bias_offsets,
                                 bias_tokens, bias_values, prompt_mask, output_counts, penalty_row, repetition,
                                 frequency, presence);
                raw = x;
            }
            if (t == 0.0f) {
                if (!processed) memcpy(x, raw, sizeof(float) * (size_t)V);
                tokens[b] = argmax(x, V);
                continue;
            }
            for (int64_t i = 0; i < V; i++) x[i] = raw[i] / t; /* the copy and the temperature in one pass */
            const float m = row_max(x, V);
            if (!(m > -INFINITY)) { /* every token banned: nothing to draw from */
                tokens[b] = 0;
                continue;
            }
            if (min_p[b] > 0.0f) { /* p_i < min_p * p_max  <=>  x_i < m + log(min_p) */
                const float lo = m + logf(min_p[b]);
                for (int64_t i = 0; i < V; i++) x[i] = x[i] < lo ? -INFINITY : x[i];
            }
            if (top_k[b] < V) {
                const float kth = kth_largest(x, V, top_k[b], scratch);
                for (int64_t i = 0; i < V; i++) x[i] = x[i] < kth ? -INFINITY : x[i];
            }
            if (top_p[b] < 1.0f) top_p_keep(x, V, m, top_p[b], cand);
            tokens[b] = race(x, V, (uint32_t)keys[2 * b], (uint32_t)keys[2 * b + 1], idx, scratch);
        }
        free(cand);
        free(scratch);
        free(idx);
    }
}
