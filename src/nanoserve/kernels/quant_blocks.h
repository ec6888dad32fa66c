/* The weight types the products read, in their GGUF layouts (codes are the GGML enum values, as in
 * kernels/quant.py), and one decoder: decode32() turns any 32 consecutive weights of a block type into
 * 32 byte codes q and w[j] = (j < 16 ? s0 q[j] + m : s1 q[j] + m1), the values gguf-py's dequantize
 * gives, bit for bit (each is one rounding of an exact product). q is unsigned (0..63) for the types with an offset or
 * a minimum and signed (-127..127) for the others (TYPE_SIGNED). Every kernel that reads weights is
 * written once over decode32() and instantiated per type (FOR_EACH_BLOCK_TYPE). */
#ifndef NANOSERVE_QUANT_BLOCKS_H
#define NANOSERVE_QUANT_BLOCKS_H

#include "simd.h"
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define T_F32 0
#define T_F16 1
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q5_0 6
#define T_Q5_1 7
#define T_Q8_0 8
#define T_Q2_K 10
#define T_Q3_K 11
#define T_Q4_K 12
#define T_Q5_K 13
#define T_Q6_K 14
#define T_IQ4_NL 20
#define T_BF16 30

#define NS_ALWAYS_INLINE static inline __attribute__((always_inline))

/* How far ahead of its reads a streaming kernel (a decode step's products, any weight type) asks for
 * the weights, where it asks: with several rows of x (floats: rows read in several passes). Measured
 * 2026-12-03 (AMD EPYC, 2 threads, `nanoserve bench kernels --types F16,BF16 --rows 1 --k 1536`): F16 at
 * 1 row 9.5-12.1 ms without, 4.2-7.0 with it. Measured again 2026-12-06 (weights 4x the L3): in one pass
 * at one row the hardware's prefetch alone was faster for every type (F16 1.25x, Q4_K 1.08-1.13x, Q8_0
 * 1.11x), with 4-8 rows slower (F16 0.67-0.83x, Q6_K 0.80x); each kernel says where it asks. */
#define STREAM_PREFETCH_BYTES 4096

/* The block types, for the switches that instantiate a kernel per type (X(type) per entry). */
#define FOR_EACH_BLOCK_TYPE(X) X(T_Q4_0) X(T_Q4_1) X(T_Q5_0) X(T_Q5_1) X(T_Q8_0) X(T_Q2_K) X(T_Q3_K) X(T_Q4_K) X(T_Q5_K) \
    X(T_Q6_K) X(T_IQ4_NL)

/* The 32-weight block types, without the K types' super-blocks (the int8 GEMM of int8_gemm.c). */
#define FOR_EACH_BLOCK32_TYPE(X) X(T_Q4_0) X(T_Q4_1) X(T_Q5_0) X(T_Q5_1) X(T_Q8_0) X(T_IQ4_NL)

#define TYPE_IS_K(t) ((t) == T_Q2_K || (t) == T_Q3_K || (t) == T_Q4_K || (t) == T_Q5_K || (t) == T_Q6_K)
#define TYPE_SIGNED(t) ((t) == T_Q8_0 || (t) == T_Q3_K || (t) == T_Q6_K || (t) == T_IQ4_NL)
/* The types whose scale changes every 16 weights (a Sub32's s0 and s1 differ). */
#define TYPE_SCALE_PER_16(t) ((t) == T_Q2_K || (t) == T_Q3_K || (t) == T_Q6_K)
#define TYPE_IS_FLOAT(t) ((t) == T_F32 || (t) == T_F16 || (t) == T_BF16)

/* Bytes of one block of the type and the weights it holds (1 for the float types). */
static inline int64_t type_block_bytes(int64_t t) {
    switch (t) {
    case T_F32: return 4;
    case T_F16: case T_BF16: return 2;
    case T_Q4_0: case T_IQ4_NL: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q2_K: return 84;
    case T_Q3_K: return 110;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

static inline int64_t type_block_weights(int64_t t) {
    return TYPE_IS_FLOAT(t) ? 1 : TYPE_IS_K(t) ? 256 : 32;
}

typedef struct {
    __m256i q;           /* 32 codes, weight j in byte j */
    float s0, s1, m, m1; /* w[j] = j < 16 ? s0 * q[j] + m : s1 * q[j] + m1 (m1 = m but on Q2_K) */
} Sub32;

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 16 bytes of nibble pairs -> 32 bytes: the low nibbles (weights 0..15), then the high ones (16..31). */
NS_ALWAYS_INLINE __m256i nibbles32(const uint8_t *p) {
    const __m128i by = _mm_loadu_si128((const __m128i *)p), low4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(by, 4), low4), _mm_and_si128(by, low4));
}

/* 32 bits (little-endian at p) -> 32 bytes, byte j = 16 where bit j is set: the fifth bit of Q5 codes. */
NS_ALWAYS_INLINE __m256i fifth_bits(const uint8_t *p) {
    static const uint8_t spread[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                       2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    int32_t bits;
    memcpy(&bits, p, 4);
    const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(bits), _mm256_loadu_si256((const __m256i *)spread));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), _mm256_set1_epi8(0x10));
}

/* Q4_K / Q5_K: the six-bit scale and minimum of sub-block j (0..7) from the super-block's 12 bytes. */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* Q6_K's stored codes of sub-block j (0..7), unsigned 0..63: the weights are d * scale * (code - 32). */
NS_ALWAYS_INLINE __m256i q6_k_unsigned_codes(const uint8_t *p, int j) {
    const int h = j >> 2, part = j & 3;
    __m256i ql = _mm256_loadu_si256((const __m256i *)(p + h * 64 + (part & 1) * 32));
    ql = _mm256_and_si256(part >> 1 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0F));
    /* the high bits 2 part, 2 part + 1 of each byte moved to bits 4, 5 in one 16-bit shift (4 - 2 part
     * places, left or right; part 2: none), the bits it carries across bytes masked off */
    __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + h * 32));
    qh = part == 0 ? _mm256_slli_epi16(qh, 4) : part == 1 ? _mm256_slli_epi16(qh, 2) : part == 3 ? _mm256_srli_epi16(qh, 2) : qh;
    return _mm256_or_si256(ql, _mm256_and_si256(qh, _mm256_set1_epi8(0x30)));
}

/* Q2_K's codes of sub-block j (0..7), 0..3: two bits of each of 32 bytes (bytes 32 (j / 4) on, bits
 * 2 (j % 4)); the weights are d * (scale & 15) * code - dmin * (scale >> 4), a scale byte per 16. */
NS_ALWAYS_INLINE __m256i q2_k_codes(const uint8_t *p, int j) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 16 + (j >> 2) * 32));
    return _mm256_and_si256(_mm256_srli_epi16(q, 2 * (j & 3)), _mm256_set1_epi8(3));
}

/* Q3_K's codes of sub-block j (0..7), unsigned 0..7: the two bits Q2_K would hold, plus 4 where bit j of
 * the high mask is set; the weights are d * scale * (code - 4). */
NS_ALWAYS_INLINE __m256i q3_k_unsigned_codes(const uint8_t *p, int j) {
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)(p + 32 + (j >> 2) * 32)),
                                                           2 * (j & 3)), _mm256_set1_epi8(3));
    /* bit j of each mask byte moved to bit 2: a 16-bit shift by at most 5 brings no other byte's bit there */
    const __m256i mask = _mm256_loadu_si256((const __m256i *)p);
    const __m256i high = j <= 2 ? _mm256_slli_epi16(mask, 2 - j) : _mm256_srli_epi16(mask, j - 2);
    return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(4)));
}

/* Q3_K's 16 scales of its 16-weight groups from its 12 scale bytes s, -32..31 as int8: scale i takes four
 * bits from the low (i < 8) or high nibble of byte i % 8 and two from byte 8 + i % 4 at bit 2 (i / 4).
 * Four scales per 32-bit word, as llama.cpp unpacks them. */
NS_ALWAYS_INLINE __m128i q3_k_scales(const uint8_t *s) {
    uint32_t w[3];
    memcpy(w, s, 12);
    const uint32_t low4 = 0x0F0F0F0F, low2 = 0x03030303;
    const __m128i u = _mm_setr_epi32((int32_t)((w[0] & low4) | ((w[2] & low2) << 4)),
                                     (int32_t)((w[1] & low4) | (((w[2] >> 2) & low2) << 4)),
                                     (int32_t)(((w[0] >> 4) & low4) | (((w[2] >> 4) & low2) << 4)),
                                     (int32_t)(((w[1] >> 4) & low4) | (((w[2] >> 6) & low2) << 4)));
    return _mm_sub_epi8(u, _mm_set1_epi8(32));
}

/* The 32 codes of sub-block j (0..7: weights 32 j .. 32 j + 31) of the K-type super-block at p: unsigned
 * 0..31 (Q4_K: 0..15) for Q4_K / Q5_K, 0..3 for Q2_K, signed -32..31 for Q6_K and -4..3 for Q3_K. */
NS_ALWAYS_INLINE __m256i k_codes(int t, const uint8_t *p, int j) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    if (t == T_Q2_K) return q2_k_codes(p, j);
    if (t == T_Q3_K) return _mm256_sub_epi8(q3_k_unsigned_codes(p, j), _mm256_set1_epi8(4));
    if (t == T_Q6_K) return _mm256_sub_epi8(q6_k_unsigned_codes(p, j), _mm256_set1_epi8(32));
    __m256i q = _mm256_loadu_si256((const __m256i *)(p + (t == T_Q4_K ? 16 : 48) + (j >> 1) * 32));
    q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, low4);
    if (t == T_Q5_K) {
        const __m256i bit = _mm256_set1_epi8((int8_t)(1 << j));
        const __m256i qh = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 16)), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(qh, bit), _mm256_set1_epi8(0x10)));
    }
    return q;
}

/* Weights 32 b .. 32 b + 31 of a row of type t (a compile-time constant where this is inlined). */
NS_ALWAYS_INLINE Sub32 decode32(int t, const uint8_t *row, int64_t b) {
    Sub32 r;
    switch (t) {
    case T_Q4_0: {
        const uint8_t *p = row + b * 18;
        const float d = f16_at(p);
        r.q = nibbles32(p + 2);
        r.s0 = r.s1 = d;
        r.m = -8.0f * d;
        break;
    }
    case T_Q4_1: {
        const uint8_t *p = row + b * 20;
        r.q = nibbles32(p + 4);
        r.s0 = r.s1 = f16_at(p);
        r.m = f16_at(p + 2);
        break;
    }
    case T_Q5_0: {
        const uint8_t *p = row + b * 22;
        const float d = f16_at(p);
        r.q = _mm256_or_si256(nibbles32(p + 6), fifth_bits(p + 2));
        r.s0 = r.s1 = d;
        r.m = -16.0f * d;
        break;
    }
    case T_Q5_1: {
        const uint8_t *p = row + b * 24;
        r.q = _mm256_or_si256(nibbles32(p + 8), fifth_bits(p + 4));
        r.s0 = r.s1 = f16_at(p);
        r.m = f16_at(p + 2);
        break;
    }
    case T_Q8_0: {
        const uint8_t *p = row + b * 34;
        r.q = _mm256_loadu_si256((const __m256i *)(p + 2));
        r.s0 = r.s1 = f16_at(p);
        r.m = 0.0f;
        break;
    }
    case T_IQ4_NL: {
        static const int8_t values[32] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                                          -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
        const uint8_t *p = row + b * 18;
        r.q = _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)values), nibbles32(p + 2));
        r.s0 = r.s1 = f16_at(p);
        r.m = 0.0f;
        break;
    }
    case T_Q2_K: {
        const int j = (int)(b & 7);
        const uint8_t *p = row + (b >> 3) * 84;
        const float d = f16_at(p + 80), dmin = f16_at(p + 82);
        r.q = k_codes(t, p, j);
        r.s0 = d * (float)(p[2 * j] & 15);
        r.s1 = d * (float)(p[2 * j + 1] & 15);
        r.m = -(dmin * (float)(p[2 * j] >> 4));
        r.m1 = -(dmin * (float)(p[2 * j + 1] >> 4));
        return r;
    }
    case T_Q3_K: {
        const int j = (int)(b & 7);
        const uint8_t *p = row + (b >> 3) * 110;
        const float d = f16_at(p + 108);
        int8_t sc[16];
        _mm_storeu_si128((__m128i *)sc, q3_k_scales(p + 96));
        r.q = k_codes(t, p, j);
        r.s0 = d * (float)sc[2 * j];
        r.s1 = d * (float)sc[2 * j + 1];
        r.m = 0.0f;
        break;
    }
    case T_Q4_K:
    case T_Q5_K: {
        const int j = (int)(b & 7);
        const uint8_t *p = row + (b >> 3) * (t == T_Q4_K ? 144 : 176);
        int sc, mn;
        k_scale_min(p + 4, j, &sc, &mn);
        r.q = k_codes(t, p, j);
        r.s0 = r.s1 = f16_at(p) * (float)sc;
        r.m = -(f16_at(p + 2) * (float)mn);
        break;
    }
    case T_Q6_K: {
        const int g = (int)(b & 7);
        const uint8_t *p = row + (b >> 3) * 210;
        r.q = k_codes(t, p, g);
        const int8_t *sc = (const int8_t *)(p + 192);
        const float d = f16_at(p + 208);
        r.s0 = d * (float)sc[2 * g];
        r.s1 = d * (float)sc[2 * g + 1];
        r.m = 0.0f;
        break;
    }
    default:
        r.q = _mm256_setzero_si256();
        r.s0 = r.s1 = r.m = 0.0f;
    }
    r.m1 = r.m;
    return r;
}

/* Eight weights k .. k + 7 of a row of a float type, as float32. */
NS_ALWAYS_INLINE __m256 load8_float_type(int t, const void *row, int64_t k) {
    if (t == T_F32) return _mm256_loadu_ps((const float *)row + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
    if (t == T_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); /* bfloat16 */
}

static inline float load1_float_type(int64_t t, const void *row, int64_t k) {
    if (t == T_F32) return ((const float *)row)[k];
    const uint16_t h = ((const uint16_t *)row)[k];
    if (t == T_F16) return _cvtsh_ss(h);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The GEMMs hand out their groups of weight rows by OpenMP's guided schedule (GEMM_SCHEDULE): each take
 * is what is left divided by the number of threads (with two: half of the groups, then half of the
 * rest, ...), down to one group, so that the threads end together. Takes of 4-6 groups left one thread
 * alone for up to a take at the end of a product: guided, SmolLM2's 576-row products ran 1.00-1.14x as
 * fast at 32-128 rows, F16 576 x 576 1.16x, larger ones 0.98-1.05x (kernels_ab.py, 30-60 rounds,
 * 2026-12-07); whole decode steps of 32 rows 1.03-1.06x (steps_ab.py). While its tiles compute a group, a
 * thread asks for the next group's rows (into L2), a slice after each tile, so that the next unpack (or
 * dequantization, weight_linear.c) finds them there; at the end of a take that group is another
 * thread's, a prefetch wasted once a take (skipping it there was 0.99-1.06x as fast). Measured (bench
 * kernels, 16384 x 2048, alternated 4 times, minimum): 32-weight types at 16 and 32 rows 3-10% faster
 * with it. */
#define GEMM_SCHEDULE schedule(guided, 1)
typedef struct {
    const char *base;
    int64_t bytes, slice, done;
} NextGroupPrefetch;

static inline NextGroupPrefetch next_group_prefetch(const BlockWeight *w, int64_t n0, int64_t cols, int64_t group_rows,
                                                    int64_t tiles) {
    const int64_t next0 = n0 + cols, rows = w->n - next0 < group_rows ? w->n - next0 : group_rows;
    NextGroupPrefetch p = {(const char *)w->data + next0 * w->row_bytes, 0, 0, 0};
    if (rows > 0) {
        p.bytes = rows * w->row_bytes;
        p.slice = (p.bytes / tiles + 63) / 64 * 64;
    }
    return p;
}

static inline void prefetch_slice(NextGroupPrefetch *p) {
    for (int64_t end = p->done + p->slice; p->done < end && p->done < p->bytes; p->done += 64)
        _mm_prefetch(p->base + p->done, _MM_HINT_T1);
}

/* The streaming kernels' weight rows between the threads: each thread walks its own contiguous share
 * (1/threads of the rows) front to back, a chunk of rows at a time, and a thread whose share is done takes
 * chunks from the back of another's, so that the threads end within a chunk of each other while each
 * reads one sequential stream until then. Static halves left the main thread waiting at the end of the
 * products for 13.6% of its time in the 1.1B Q4_K_M's batch-1 decode (perf, 2026-12-07). A share is
 * front (low 32 bits) .. back (high 32 bits), claimed by compare-and-swap, one cache line each. */
#define ROW_SHARES_MAX 64
/* Chunks of 128 KiB (~8 us of one thread's reading): whole batch-1 steps 1.01-1.06x as fast as with 64 KiB,
 * and those 1.02-1.06x as fast as with 16 KiB (steps_ab.py, SmolLM2 Q8_0 and the 1.1B Q4_K_M, 2026-12-07) */
#define STREAM_CHUNK_BYTES 131072
typedef struct {
    _Alignas(64) uint64_t span;
} RowShare;

typedef struct {
    RowShare share[ROW_SHARES_MAX];
    int count;
    int64_t chunk;
} RowShares;

/* Before the parallel region: rows 0 .. N - 1 of row_bytes each, in one share per thread the region may
 * have (a smaller team takes the missing threads' shares as it takes any other's). */
static inline void row_shares_init(RowShares *s, int64_t N, int64_t row_bytes) {
    const int n = omp_get_max_threads();
    s->count = n < 1 ? 1 : n > ROW_SHARES_MAX ? ROW_SHARES_MAX : n;
    s->chunk = row_bytes >= STREAM_CHUNK_BYTES ? 1 : STREAM_CHUNK_BYTES / row_bytes;
    for (int i = 0; i < s->count; i++)
        s->share[i].span = (uint64_t)(N * (i + 1) / s->count) << 32 | (uint64_t)(N * i / s->count);
}

/* Inside the region: the calling thread's next rows, *begin .. *begin + (returned count) - 1, 0 when none
 * are left anywhere. */
static inline int64_t row_shares_take(RowShares *s, int64_t *begin) {
    const int own = omp_get_thread_num() % s->count;
    for (int i = 0; i < s->count; i++) {
        RowShare *r = &s->share[(own + i) % s->count];
        uint64_t cur = __atomic_load_n(&r->span, __ATOMIC_RELAXED);
        for (;;) {
            const uint64_t front = cur & 0xffffffffu, back = cur >> 32;
            if (front >= back) break;
            uint64_t next, first, end;
            if (i == 0) { /* its own share: from the front */
                first = front;
                end = back - front > (uint64_t)s->chunk ? front + (uint64_t)s->chunk : back;
                next = back << 32 | end;
            } else { /* another's: from the back */
                end = back;
                first = back - front > (uint64_t)s->chunk ? back - (uint64_t)s->chunk : front;
                next = first << 32 | front;
            }
            if (__atomic_compare_exchange_n(&r->span, &cur, next, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *begin = (int64_t)first;
                return (int64_t)(end - first);
            }
        }
    }
    return 0;
}

/* A parallel region in which each of the N weight rows (row_bytes each) runs BODY once, with n its index,
 * handed out by RowShares: the streaming kernels' loop over the weight rows. */
#define FOR_EACH_SHARED_ROW(N, row_bytes, n, BODY)                                                           \
    do {                                                                                                     \
        RowShares shares_;                                                                                   \
        row_shares_init(&shares_, N, row_bytes);                                                             \
        _Pragma("omp parallel") {                                                                            \
            int64_t n0_, count_;                                                                             \
            while ((count_ = row_shares_take(&shares_, &n0_)) > 0)                                           \
                for (int64_t n = n0_; n < n0_ + count_; n++) BODY                                            \
        }                                                                                                    \
    } while (0)

#endif
