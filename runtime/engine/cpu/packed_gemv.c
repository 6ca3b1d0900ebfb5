/* Projections of a few tokens over packed weights, on the CPU (runtime/engine/cpu/packed.py loads it with
 * ctypes and packs the weights).
 *
 * Why: a decode step on a CPU reads every weight once and is bound by memory bandwidth. Weights imported from
 * a quantised GGUF are exactly 4-bit (Q4_1: w = d*q + m, q in 0..15) or 8-bit (Q8_0: w = d*q) values in groups
 * of 32, so packed that way they are the same numbers in a fifth (a quarter) of float32's bytes. torch has no
 * kernel that is fast at one row over such weights; this one unpacks a group into registers and multiplies
 * it with every token's activations there, in float32 (AVX2, FMA, F16C), rows split over OpenMP threads
 * (torch's own pool: the soname is shared, so the two never run at once).
 *
 * A group is stored as its block: Q4: fp16 d, fp16 m, 16 bytes (byte j: element j in the low nibble,
 * element j + 16 in the high one). Q8: fp16 d, 32 int8. Row r of a [n, k] weight is k / 32 blocks. */

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32
#define MAX_TOKENS 8
#define AVX2 __attribute__((target("avx2,fma,f16c")))

typedef struct { uint16_t d, m; uint8_t q[16]; } block_q4;
typedef struct { uint16_t d; int8_t q[32]; } block_q8;

int thaw_gemv_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* Bumped whenever a signature below changes: a library built from older sources is then not used. */
int thaw_packed_abi(void) { return 2; }

int thaw_block_bytes(int bits) { return bits == 4 ? (int)sizeof(block_q4) : (int)sizeof(block_q8); }

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AVX2 static inline __m256 widen_u8(__m128i bytes) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)); }
AVX2 static inline __m256 widen_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The 32 products of a group's unpacked weights (w[0..3], 8 each) with activations xg, summed per lane. */
AVX2 static inline __m256 dot_group(const __m256 w[4], const float *xg) {
    __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xg));
    p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + 8), p);
    p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + 16), p);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + 24), p);
}

/* y[t, r] = sum_k x[t, k] * w[r, k] for rows [r0, r1) of a Q4 weight; xsum[t, g]: the sum of token t's
 * activations over group g (the m term of each group is m * xsum). */
AVX2 static void q4_rows(const float *x, const float *xsum, int tokens, int k, const block_q4 *w,
                         long r0, long r1, long n, float *y) {
    const int groups = k / GROUP;
    const __m128i low = _mm_set1_epi8(0x0F);
    for (long r = r0; r < r1; r++) {
        const block_q4 *b = w + r * groups;
        __m256 acc[MAX_TOKENS];
        float macc[MAX_TOKENS];
        for (int t = 0; t < tokens; t++) { acc[t] = _mm256_setzero_ps(); macc[t] = 0.0f; }
        for (int g = 0; g < groups; g++, b++) {
            __m128i packed = _mm_loadu_si128((const __m128i *)b->q);
            __m128i lo = _mm_and_si128(packed, low), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
            const __m256 wg[4] = {widen_u8(lo), widen_u8(_mm_srli_si128(lo, 8)), widen_u8(hi),
                                  widen_u8(_mm_srli_si128(hi, 8))};
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(b->d));
            const float m = _cvtsh_ss(b->m);
            for (int t = 0; t < tokens; t++) {
                acc[t] = _mm256_fmadd_ps(d, dot_group(wg, x + (long)t * k + g * GROUP), acc[t]);
                macc[t] += m * xsum[t * groups + g];
            }
        }
        for (int t = 0; t < tokens; t++) y[(long)t * n + r] = hsum(acc[t]) + macc[t];
    }
}

AVX2 static void q8_rows(const float *x, int tokens, int k, const block_q8 *w, long r0, long r1, long n,
                         float *y) {
    const int groups = k / GROUP;
    for (long r = r0; r < r1; r++) {
        const block_q8 *b = w + r * groups;
        __m256 acc[MAX_TOKENS];
        for (int t = 0; t < tokens; t++) acc[t] = _mm256_setzero_ps();
        for (int g = 0; g < groups; g++, b++) {
            const __m256 wg[4] = {widen_i8(b->q), widen_i8(b->q + 8), widen_i8(b->q + 16), widen_i8(b->q + 24)};
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(b->d));
            for (int t = 0; t < tokens; t++)
                acc[t] = _mm256_fmadd_ps(d, dot_group(wg, x + (long)t * k + g * GROUP), acc[t]);
        }
        for (int t = 0; t < tokens; t++) y[(long)t * n + r] = hsum(acc[t]);
    }
}

/* Packing: each group of a float32 [n, k] weight as a block, if the block gives back every value exactly.
 * Q4 takes the group's minimum as m and (max - min) / 15 as d, Q8 max|w| / 127 as d, both rounded to fp16 as
 * the GGUF stores them; a group whose values are not d*q (+ m) for those is not packable. Returns 0, or -1
 * (a group not exact; `out` is then partly written and must not be used). */
AVX2 static inline __m128i narrow_to_i8(__m256i v) {
    __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    __m128i w16 = _mm_packs_epi32(lo, hi);
    return _mm_packs_epi16(w16, w16);
}

/* One group's q values for scale d (> 0) and offset m, rounded and clamped to [lo, hi], into q; -1 unless
 * every d*q + m gives back its w exactly (d*q is exact: an fp16 times a small integer). */
AVX2 static int group_q(const float *w, float d, float m, float lo, float hi, int8_t q[GROUP]) {
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m), inv = _mm256_set1_ps(1.0f / d);
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    for (int j = 0; j < GROUP; j += 8) {
        __m256 v = _mm256_loadu_ps(w + j);
        __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(v, vm), inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, vlo), vhi);
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(_mm256_mul_ps(vd, r), vm), v, _CMP_NEQ_UQ)))
            return -1;
        __m128i i = narrow_to_i8(_mm256_cvtps_epi32(r));
        _mm_storel_epi64((__m128i *)(q + j), i);
    }
    return 0;
}

AVX2 static void group_range(const float *w, float *lo, float *hi, float *amax) {
    __m256 mn = _mm256_loadu_ps(w), mx = mn;
    for (int j = 8; j < GROUP; j += 8) {
        __m256 v = _mm256_loadu_ps(w + j);
        mn = _mm256_min_ps(mn, v);
        mx = _mm256_max_ps(mx, v);
    }
    float a[8], b[8];
    _mm256_storeu_ps(a, mn);
    _mm256_storeu_ps(b, mx);
    *lo = a[0], *hi = b[0];
    for (int j = 1; j < 8; j++) { *lo = a[j] < *lo ? a[j] : *lo; *hi = b[j] > *hi ? b[j] : *hi; }
    *amax = -*lo > *hi ? -*lo : *hi;
}

AVX2 static int q4_pack_group(const float *w, block_q4 *b) {
    float lo, hi, amax;
    group_range(w, &lo, &hi, &amax);
    b->d = _cvtss_sh((hi - lo) / 15.0f, 0);
    b->m = _cvtss_sh(lo, 0);
    const float d = _cvtsh_ss(b->d), m = _cvtsh_ss(b->m);
    int8_t q[GROUP] = {0};
    if (d > 0.0f ? group_q(w, d, m, 0.0f, 15.0f, q) : (lo != hi || m != lo))
        return -1;
    for (int j = 0; j < 16; j++) b->q[j] = (uint8_t)q[j] | (uint8_t)(q[j + 16] << 4);
    return 0;
}

AVX2 static int q8_pack_group(const float *w, block_q8 *b) {
    float lo, hi, amax;
    group_range(w, &lo, &hi, &amax);
    b->d = _cvtss_sh(amax / 127.0f, 0);
    const float d = _cvtsh_ss(b->d);
    if (d > 0.0f)
        return group_q(w, d, 0.0f, -127.0f, 127.0f, b->q);
    memset(b->q, 0, GROUP);
    return amax == 0.0f ? 0 : -1;
}

int thaw_pack(int bits, const float *w, long n, int k, void *out, int threads) {
    if (k % GROUP || (bits != 4 && bits != 8))
        return -1;
    const long groups = n * (k / GROUP);
    int inexact = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : inexact)
    for (long g = 0; g < groups; g++) {
        if (inexact)
            continue;
        inexact |= bits == 4 ? q4_pack_group(w + g * GROUP, (block_q4 *)out + g)
                             : q8_pack_group(w + g * GROUP, (block_q8 *)out + g);
    }
    return inexact ? -1 : 0;
}

/* Rows in chunks of 16, spread over `threads`: a chunk of a 576-wide Q4 weight is 5.6 KiB. */
#define ROWS_PER_CHUNK 16

/* y [tokens, n] = x [tokens, k] @ w.T for a packed [n, k] weight (`bits` 4 or 8); tokens <= 8, k % 32 == 0.
 * Returns 0, or -1 for arguments out of range. */
int thaw_packed_gemv(int bits, const float *x, int tokens, int k, const void *w, long n, float *y, int threads) {
    if (tokens < 1 || tokens > MAX_TOKENS || k % GROUP || (bits != 4 && bits != 8))
        return -1;
    const int groups = k / GROUP;
    float xsum[tokens * groups];  /* at most 8 * k / 32 floats: k bytes */
    if (bits == 4)
        for (int t = 0; t < tokens; t++)
            for (int g = 0; g < groups; g++) {
                float s = 0.0f;
                for (int j = 0; j < GROUP; j++) s += x[(long)t * k + g * GROUP + j];
                xsum[t * groups + g] = s;
            }
    const long chunks = (n + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long c = 0; c < chunks; c++) {
        long r0 = c * ROWS_PER_CHUNK, r1 = r0 + ROWS_PER_CHUNK < n ? r0 + ROWS_PER_CHUNK : n;
        if (bits == 4)
            q4_rows(x, xsum, tokens, k, (const block_q4 *)w, r0, r1, n, y);
        else
            q8_rows(x, tokens, k, (const block_q8 *)w, r0, r1, n, y);
    }
    return 0;
}
