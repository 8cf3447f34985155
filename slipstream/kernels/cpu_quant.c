/* CPU kernels over GGUF-quantized weights, compiled at first use by
 * kernels/cpu_library.py with `cc -O3 -march=native` (so each machine gets its
 * own vector width: AVX2, AVX-512, ...), loaded with ctypes.
 *
 * Weights stay in GGUF's block layout, row-major: a row of `cols` elements is
 * cols / QK blocks of BLOCK_BYTES bytes; rows are contiguous. Activations and
 * outputs are fp32.
 *
 *   ss_matmul     y[m, rows] = x[m, cols] @ W^T, W given as segments (fused
 *                 q/k/v or gate/up shards, each with its own format) whose rows
 *                 are stacked along the output.
 *   ss_dequant    W -> fp32 [rows, cols] (large-m products go through BLAS).
 *   ss_get_rows   embedding lookup: the rows `ids` of W, dequantized.
 *   ss_decode_attention  one new token per sequence over the paged KV cache
 *                 (no gather: blocks are read in place, online softmax).
 *   ss_tree_attention  a few tokens per sequence under a tree mask
 *                 (cpu_tree_attention.c).
 *   ss_decode_step, ss_tree_step  a whole model step (cpu_decoder.c).
 *   ss_eagle_pass, ss_eagle_chain  EAGLE's draft head (cpu_eagle.c).
 *   ss_row_argmax, ss_row_candidates  greedy choice; a row's log-sum-exp and
 *                 its likeliest columns for top-k / top-p sampling.
 *   ss_set_amx    products of several rows of x on AMX tiles, where there are
 *                 some (cpu_amx.c).
 *
 * Threads: a small pool of spinning workers. Work is split into chunks that
 * threads claim with an atomic counter; the caller takes chunks too and waits
 * only for chunks that were claimed. A worker the OS has descheduled claims
 * nothing, so it never holds the others at a barrier (OpenMP's barriers make a
 * shared 2-core machine collapse to a few tokens a second).
 */
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#include <unistd.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

/* ---- formats (ggml type ids) ------------------------------------------ */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8,
       T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30 };

static inline float h2f(const uint8_t *p) {
    uint16_t h; memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, u;
    if (e == 0) {
        if (m == 0) u = s;
        else { e = 113; while (!(m & 1024)) { m <<= 1; e--; } u = s | (e << 23) | ((m & 1023) << 13); }
    } else if (e == 31) u = s | 0x7f800000u | (m << 13);
    else u = s | ((e + 112) << 23) | (m << 13);
    float f; memcpy(&f, &u, 4); return f;
#endif
}

static inline float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }

#define T_Q4X16 100   /* Q4_0 / Q4_1 repacked in groups of 16 rows: cpu_q4x16.c */
#define T_Q8X16 101   /* Q8_0 repacked in groups of 16 rows: cpu_q8x16.c */
static int block_elems(int t) { return (t == T_Q4_K || t == T_Q5_K || t == T_Q6_K) ? 256 : (t == T_F32 || t == T_F16 || t == T_BF16) ? 1 : 32; }
static int block_bytes(int t) {
    switch (t) {
    case T_F32: return 4; case T_F16: case T_BF16: return 2;
    case T_Q4_0: return 18; case T_Q4_1: case T_Q4X16: return 20; case T_Q8_0: case T_Q8X16: return 34;
    case T_Q4_K: return 144; case T_Q5_K: return 176; case T_Q6_K: return 210;
    }
    return 0;
}

int ss_supported(int t) { return block_bytes(t) > 0; }

static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) { *d = q[j] & 63; *m = q[j + 4] & 63; }
    else { *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

/* One block -> block_elems(t) floats. */
static void dequant_block(int t, const uint8_t *b, float *y) {
    switch (t) {
    case T_F32: memcpy(y, b, 4); return;
    case T_F16: y[0] = h2f(b); return;
    case T_BF16: { uint16_t v; memcpy(&v, b, 2); y[0] = bf2f(v); return; }
    case T_Q4_0: {
        float d = h2f(b); const uint8_t *q = b + 2;
        for (int i = 0; i < 16; i++) { y[i] = ((q[i] & 15) - 8) * d; y[i + 16] = ((q[i] >> 4) - 8) * d; }
        return; }
    case T_Q4_1: {
        float d = h2f(b), m = h2f(b + 2); const uint8_t *q = b + 4;
        for (int i = 0; i < 16; i++) { y[i] = (q[i] & 15) * d + m; y[i + 16] = (q[i] >> 4) * d + m; }
        return; }
    case T_Q8_0: {
        float d = h2f(b); const int8_t *q = (const int8_t *)(b + 2);
        for (int i = 0; i < 32; i++) y[i] = q[i] * d;
        return; }
    case T_Q4_K: case T_Q5_K: {
        float d = h2f(b), dmin = h2f(b + 2); const uint8_t *sc = b + 4;
        const uint8_t *qh = b + 16, *ql = t == T_Q5_K ? b + 48 : b + 16;
        for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
            uint8_t s1, m1, s2, m2;
            scale_min_k4(is, sc, &s1, &m1); scale_min_k4(is + 1, sc, &s2, &m2);
            float d1 = d * s1, n1 = dmin * m1, d2 = d * s2, n2 = dmin * m2;
            int u1 = 1 << is, u2 = 2 << is;
            for (int l = 0; l < 32; l++) {
                int h1 = t == T_Q5_K ? ((qh[l] & u1) ? 16 : 0) : 0;
                int h2 = t == T_Q5_K ? ((qh[l] & u2) ? 16 : 0) : 0;
                y[j + l] = d1 * ((ql[l] & 15) + h1) - n1;
                y[j + 32 + l] = d2 * ((ql[l] >> 4) + h2) - n2;
            }
            ql += 32;
        }
        return; }
    case T_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128; const int8_t *sc = (const int8_t *)(b + 192);
        float d = h2f(b + 208);
        for (int n = 0; n < 256; n += 128) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = (int)((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
                int q2 = (int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[n + l] = d * sc[is] * q1; y[n + l + 32] = d * sc[is + 2] * q2;
                y[n + l + 64] = d * sc[is + 4] * q3; y[n + l + 96] = d * sc[is + 6] * q4;
            }
            ql += 64; qh += 32; sc += 8;
        }
        return; }
    }
}

/* ---- dot products of one weight row with int8-quantized activations ---- */
/* As llama.cpp does: x is quantized once per call to int8 in blocks of 32
 * (scale dx, and sx = dx * sum of the block's int8 values), and each weight
 * block's integers meet x's in an integer dot product:
 *   Q4_0: d * dx * (sum u*qx - 8 * sum qx)      (u: the 4-bit value, 0..15)
 *   Q4_1: d * dx * sum u*qx + m * sx
 *   Q8_0: d * dx * sum w*qx                                                 */
typedef struct { const int8_t *q; const float *d; const float *s; } qx_t;

#if defined(__AVX2__)
static inline __m256i nibbles(const uint8_t *q) {
    /* 16 bytes -> 32 values: low nibbles are elements 0..15, high ones 16..31 */
    __m128i b = _mm_loadu_si128((const __m128i *)q), m = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}
static inline __m256i dot_u8_i8(__m256i u, __m256i s) {   /* -> 8 int32 partial sums */
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
static inline float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
#endif

/* AVX-512 (BW + DQ): two 32-blocks per step for one row of x (decode). */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define SS_AVX512 1
static inline __m512i nibbles2(const uint8_t *q0, const uint8_t *q1) {
    /* two blocks' 16 nibble bytes -> 64 values in x order: b0 lo, b0 hi, b1 lo, b1 hi */
    __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)q1), _mm_loadu_si128((const __m128i *)q0));
    __m256i m = _mm256_set1_epi8(15);
    __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, m)),
                                   _mm256_and_si256(_mm256_srli_epi16(v, 4), m), 1);
    return _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(3, 1, 2, 0));
}
static inline __m512i dot512_u8_i8(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
static inline __m512 two_scales(float a, float b) {
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}
#endif

/* nx (1..DOT_MAX_X) rows of x against one weight row: out[i] = <w, x[i]>. The
 * weight's blocks are unpacked once for all nx rows (a prompt's rows four at a
 * time), and each row's sums run in the same order whatever nx, so a row of x
 * gives the same bits alone (a decode step) as among others (a prompt, a batch).
 * Inlined: `dotn_q` calls them with nx = 1 as a constant for the one-row case. */
#define DOT_MAX_X 4
/* a * b + c, rounded once where the CPU fuses them, else twice. Written out: the
 * compiler fuses a product and a sum of plain expressions where it sees fit, and
 * not always alike in the one-row code and the n-row loops (seen: an AVX-512 build
 * without VNNI gave a row other bits among three rows than alone). Without fused
 * instructions it fuses nothing, so the plain form is then as fixed. */
#if defined(__FP_FAST_FMAF)
#define FMA(a, b, c) fmaf(a, b, c)
#else
#define FMA(a, b, c) ((a) * (b) + (c))
#endif
#define SS_INLINE static inline __attribute__((always_inline))

SS_INLINE void dotn_q4_0(const uint8_t *w, const qx_t *x, int nx, int64_t nb, float *out) {
#if defined(SS_AVX512)
    __m512 acc[DOT_MAX_X]; float off[DOT_MAX_X]; int64_t b = 0;
    for (int i = 0; i < nx; i++) { acc[i] = _mm512_setzero_ps(); off[i] = 0; }
    for (; b + 2 <= nb; b += 2, w += 36) {
        __m512i u = nibbles2(w + 2, w + 20);
        float d0 = h2f(w), d1 = h2f(w + 18);
        for (int i = 0; i < nx; i++) {
            __m512i s = dot512_u8_i8(u, _mm512_loadu_si512(x[i].q + 32 * b));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), two_scales(d0 * x[i].d[b], d1 * x[i].d[b + 1]), acc[i]);
            off[i] = FMA(d1, x[i].s[b + 1], FMA(d0, x[i].s[b], off[i]));
        }
    }
    for (int i = 0; i < nx; i++) out[i] = _mm512_reduce_add_ps(acc[i]) - 8 * off[i];
    for (; b < nb; b++, w += 18) {
        const uint8_t *q = w + 2; float d = h2f(w);
        for (int i = 0; i < nx; i++) {
            const int8_t *v = x[i].q + 32 * b; int si = 0;
            for (int k = 0; k < 16; k++) si += ((q[k] & 15) - 8) * v[k] + ((q[k] >> 4) - 8) * v[k + 16];
            out[i] = FMA(d * x[i].d[b], (float)si, out[i]);
        }
    }
#elif defined(__AVX2__)
    __m256 acc[DOT_MAX_X]; float off[DOT_MAX_X];
    for (int i = 0; i < nx; i++) { acc[i] = _mm256_setzero_ps(); off[i] = 0; }
    for (int64_t b = 0; b < nb; b++, w += 18) {
        __m256i u = nibbles(w + 2);
        float d = h2f(w);
        for (int i = 0; i < nx; i++) {
            __m256i s = dot_u8_i8(u, _mm256_loadu_si256((const __m256i *)(x[i].q + 32 * b)));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * x[i].d[b]), acc[i]);
            off[i] = FMA(d, x[i].s[b], off[i]);
        }
    }
    for (int i = 0; i < nx; i++) out[i] = hsum(acc[i]) - 8 * off[i];
#else
    for (int i = 0; i < nx; i++) out[i] = 0;
    for (int64_t b = 0; b < nb; b++, w += 18) {
        const uint8_t *q = w + 2; float d = h2f(w);
        for (int i = 0; i < nx; i++) {
            const int8_t *v = x[i].q + 32 * b; int s = 0;
            for (int k = 0; k < 16; k++) s += ((q[k] & 15) - 8) * v[k] + ((q[k] >> 4) - 8) * v[k + 16];
            out[i] = FMA(d * x[i].d[b], (float)s, out[i]);
        }
    }
#endif
}

SS_INLINE void dotn_q4_1(const uint8_t *w, const qx_t *x, int nx, int64_t nb, float *out) {
#if defined(SS_AVX512)
    __m512 acc[DOT_MAX_X]; float off[DOT_MAX_X]; int64_t b = 0;
    for (int i = 0; i < nx; i++) { acc[i] = _mm512_setzero_ps(); off[i] = 0; }
    for (; b + 2 <= nb; b += 2, w += 40) {
        __m512i u = nibbles2(w + 4, w + 24);
        float d0 = h2f(w), m0 = h2f(w + 2), d1 = h2f(w + 20), m1 = h2f(w + 22);
        for (int i = 0; i < nx; i++) {
            __m512i s = dot512_u8_i8(u, _mm512_loadu_si512(x[i].q + 32 * b));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), two_scales(d0 * x[i].d[b], d1 * x[i].d[b + 1]), acc[i]);
            off[i] = FMA(m1, x[i].s[b + 1], FMA(m0, x[i].s[b], off[i]));
        }
    }
    for (int i = 0; i < nx; i++) out[i] = _mm512_reduce_add_ps(acc[i]) + off[i];
    for (; b < nb; b++, w += 20) {
        const uint8_t *q = w + 4; float d = h2f(w), m = h2f(w + 2);
        for (int i = 0; i < nx; i++) {
            const int8_t *v = x[i].q + 32 * b; int si = 0;
            for (int k = 0; k < 16; k++) si += (q[k] & 15) * v[k] + (q[k] >> 4) * v[k + 16];
            out[i] = FMA(m, x[i].s[b], FMA(d * x[i].d[b], (float)si, out[i]));
        }
    }
#elif defined(__AVX2__)
    __m256 acc[DOT_MAX_X]; float off[DOT_MAX_X];
    for (int i = 0; i < nx; i++) { acc[i] = _mm256_setzero_ps(); off[i] = 0; }
    for (int64_t b = 0; b < nb; b++, w += 20) {
        __m256i u = nibbles(w + 4);
        float d = h2f(w), m = h2f(w + 2);
        for (int i = 0; i < nx; i++) {
            __m256i s = dot_u8_i8(u, _mm256_loadu_si256((const __m256i *)(x[i].q + 32 * b)));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * x[i].d[b]), acc[i]);
            off[i] = FMA(m, x[i].s[b], off[i]);
        }
    }
    for (int i = 0; i < nx; i++) out[i] = hsum(acc[i]) + off[i];
#else
    for (int i = 0; i < nx; i++) out[i] = 0;
    for (int64_t b = 0; b < nb; b++, w += 20) {
        const uint8_t *q = w + 4; float d = h2f(w), m = h2f(w + 2);
        for (int i = 0; i < nx; i++) {
            const int8_t *v = x[i].q + 32 * b; int s = 0;
            for (int k = 0; k < 16; k++) s += (q[k] & 15) * v[k] + (q[k] >> 4) * v[k + 16];
            out[i] = FMA(m, x[i].s[b], FMA(d * x[i].d[b], (float)s, out[i]));
        }
    }
#endif
}

SS_INLINE void dotn_q8_0(const uint8_t *w, const qx_t *x, int nx, int64_t nb, float *out) {
#if defined(SS_AVX512)
    __m512 acc[DOT_MAX_X]; int64_t b = 0;
    for (int i = 0; i < nx; i++) acc[i] = _mm512_setzero_ps();
    for (; b + 2 <= nb; b += 2, w += 68) {
        __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(w + 2))),
                                       _mm256_loadu_si256((const __m256i *)(w + 36)), 1);
        /* |a| * (sign(a) * v): AVX-512 has no sign_epi8; negate v where a < 0 */
        __mmask64 neg = _mm512_movepi8_mask(a);
        __m512i u = _mm512_abs_epi8(a);
        float d0 = h2f(w), d1 = h2f(w + 34);
        for (int i = 0; i < nx; i++) {
            __m512i v = _mm512_loadu_si512(x[i].q + 32 * b);
            __m512i s = dot512_u8_i8(u, _mm512_mask_sub_epi8(v, neg, _mm512_setzero_si512(), v));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), two_scales(d0 * x[i].d[b], d1 * x[i].d[b + 1]), acc[i]);
        }
    }
    for (int i = 0; i < nx; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
    for (; b < nb; b++, w += 34) {
        const int8_t *q = (const int8_t *)(w + 2); float d = h2f(w);
        for (int i = 0; i < nx; i++) {
            const int8_t *v = x[i].q + 32 * b; int si = 0;
            for (int k = 0; k < 32; k++) si += q[k] * v[k];
            out[i] = FMA(d * x[i].d[b], (float)si, out[i]);
        }
    }
#elif defined(__AVX2__)
    __m256 acc[DOT_MAX_X];
    for (int i = 0; i < nx; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += 34) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(w + 2)), u = _mm256_sign_epi8(a, a);
        float d = h2f(w);
        for (int i = 0; i < nx; i++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(x[i].q + 32 * b));
            __m256i s = dot_u8_i8(u, _mm256_sign_epi8(v, a));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * x[i].d[b]), acc[i]);
        }
    }
    for (int i = 0; i < nx; i++) out[i] = hsum(acc[i]);
#else
    for (int i = 0; i < nx; i++) out[i] = 0;
    for (int64_t b = 0; b < nb; b++, w += 34) {
        const int8_t *q = (const int8_t *)(w + 2); float d = h2f(w);
        for (int i = 0; i < nx; i++) {
            const int8_t *v = x[i].q + 32 * b; int s = 0;
            for (int k = 0; k < 32; k++) s += q[k] * v[k];
            out[i] = FMA(d * x[i].d[b], (float)s, out[i]);
        }
    }
#endif
}

/* out[i] = <w, x[i]> for nx (1..DOT_MAX_X) rows of x; t: Q4_0, Q4_1 or Q8_0 (the file's blocks) */
static void dotn_q(int t, const uint8_t *w, const qx_t *x, int nx, int64_t nb, float *out) {
    if (nx == 1) {             /* decode: the same arithmetic, specialized */
        if (t == T_Q4_1) dotn_q4_1(w, x, 1, nb, out);
        else if (t == T_Q4_0) dotn_q4_0(w, x, 1, nb, out);
        else dotn_q8_0(w, x, 1, nb, out);
    } else {
        if (t == T_Q4_1) dotn_q4_1(w, x, nx, nb, out);
        else if (t == T_Q4_0) dotn_q4_0(w, x, nx, nb, out);
        else dotn_q8_0(w, x, nx, nb, out);
    }
}

/* x [m, cols] -> int8 blocks of 32 with their scales and scaled sums. */
static void quantize_x(const float *x, int64_t n, int8_t *q, float *d, float *s) {
    for (int64_t b = 0; b < n / 32; b++) {
        const float *v = x + 32 * b;
        float amax = 0;
        for (int i = 0; i < 32; i++) { float a = fabsf(v[i]); amax = a > amax ? a : amax; }   /* inlined, vectorized */
        float scale = amax / 127, inv = amax > 0 ? 127 / amax : 0;
        int sum = 0;
        /* rintf (no errno, unlike lrintf) compiles to one rounding instruction: the same
         * round-half-to-even result for |v * inv| <= 127 */
        for (int i = 0; i < 32; i++) { int t = (int)rintf(v[i] * inv); q[32 * b + i] = (int8_t)t; sum += t; }
        d[b] = scale; s[b] = scale * sum;
    }
}

static float dot_f(const float *a, const float *x, int64_t n) {
    float acc[16] = {0}; int64_t i = 0;
    for (; i + 16 <= n; i += 16) for (int l = 0; l < 16; l++) acc[l] += a[i + l] * x[i + l];
    float s = 0; for (int l = 0; l < 16; l++) s += acc[l];
    for (; i < n; i++) s += a[i] * x[i];
    return s;
}

/* out[j] = <q, k[j]> * scale for nk keys (attention scores: one query against a
 * tile of keys). Every score's sums in one order: 16 lanes over the vector (lane l
 * adds elements l, l + 16, ... by fused multiply-adds, in order), the lanes then
 * added pairwise (l + l+8, then + l+4, then (0 + 2) + (1 + 3)), the tail of n % 16
 * last. The order does not depend on nk or on a key's place among the keys, so a
 * query's score is the same bits in the decode attention and in the tree
 * attention. With AVX-512 (AVX2), 16 (4) keys at a time: their lane sums are
 * independent chains, and the pairwise additions of all of them are a few vector
 * additions of shuffled sums (a transposition), not a reduction per score. */
static void dots_keys_one(const float *q, const float *k, int64_t n, float scale, float *out) {
    int64_t n16 = n / 16 * 16;
    float acc[16] = {0}, s8[8], s4[4];
#if defined(__FMA__) || defined(SS_AVX512)
    for (int64_t i = 0; i < n16; i += 16) for (int l = 0; l < 16; l++) acc[l] = fmaf(q[i + l], k[i + l], acc[l]);
#else
    for (int64_t i = 0; i < n16; i += 16) for (int l = 0; l < 16; l++) acc[l] += q[i + l] * k[i + l];
#endif
    for (int l = 0; l < 8; l++) s8[l] = acc[l] + acc[l + 8];
    for (int l = 0; l < 4; l++) s4[l] = s8[l] + s8[l + 4];
    float v = (s4[0] + s4[2]) + (s4[1] + s4[3]);
    for (int64_t i = n16; i < n; i++) v += q[i] * k[i];
    *out = v * scale;
}

static void dots_keys(const float *q, const float *const *k, int nk, int64_t n, float scale, float *out) {
    int j = 0;
#if defined(SS_AVX512)
    if (n % 16 == 0) {
        const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        for (; j < nk; j += 16) {
            const float *kk[16];
            for (int u = 0; u < 16; u++) kk[u] = j + u < nk ? k[j + u] : q;   /* padding: discarded */
            __m512 acc[16];
            for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();
            for (int64_t i = 0; i < n; i += 16) {
                __m512 qv = _mm512_loadu_ps(q + i);
                for (int u = 0; u < 16; u++) acc[u] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kk[u] + i), acc[u]);
            }
            __m512 t[8], w[4];
            for (int u = 0; u < 8; u++)      /* [A l + l+8 | B l + l+8], l < 8 */
                t[u] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * u], acc[2 * u + 1], 0x44),
                                     _mm512_shuffle_f32x4(acc[2 * u], acc[2 * u + 1], 0xEE));
            for (int u = 0; u < 4; u++)      /* [A s4 | B s4 | C s4 | D s4] */
                w[u] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * u], t[2 * u + 1], 0x88),
                                     _mm512_shuffle_f32x4(t[2 * u], t[2 * u + 1], 0xDD));
            /* lane c of x0: [key c: s0 + s2, s1 + s3, key c + 4: the same]; x1: keys c + 8, c + 12 */
            __m512 x0 = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 2, 3, 2)));
            __m512 x1 = _mm512_add_ps(_mm512_shuffle_ps(w[2], w[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                      _mm512_shuffle_ps(w[2], w[3], _MM_SHUFFLE(3, 2, 3, 2)));
            __m512 v = _mm512_add_ps(_mm512_shuffle_ps(x0, x1, _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_ps(x0, x1, _MM_SHUFFLE(3, 1, 3, 1)));
            /* lane c now holds keys c, c + 4, c + 8, c + 12: back in key order */
            v = _mm512_mul_ps(_mm512_permutexvar_ps(order, v), _mm512_set1_ps(scale));
            if (nk - j >= 16) _mm512_storeu_ps(out + j, v);
            else _mm512_mask_storeu_ps(out + j, (__mmask16)((1u << (nk - j)) - 1), v);
        }
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (n % 16 == 0) {
        for (; j + 4 <= nk; j += 4) {
            __m256 lo[4], hi[4], s8[4];
            for (int u = 0; u < 4; u++) lo[u] = hi[u] = _mm256_setzero_ps();
            for (int64_t i = 0; i < n; i += 16) {
                __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
                for (int u = 0; u < 4; u++) {
                    lo[u] = _mm256_fmadd_ps(q0, _mm256_loadu_ps(k[j + u] + i), lo[u]);
                    hi[u] = _mm256_fmadd_ps(q1, _mm256_loadu_ps(k[j + u] + i + 8), hi[u]);
                }
            }
            for (int u = 0; u < 4; u++) s8[u] = _mm256_add_ps(lo[u], hi[u]);
            /* [A s4 | B s4], [C s4 | D s4] */
            __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(s8[0], s8[1], 0x20),
                                      _mm256_permute2f128_ps(s8[0], s8[1], 0x31));
            __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(s8[2], s8[3], 0x20),
                                      _mm256_permute2f128_ps(s8[2], s8[3], 0x31));
            /* [A: s0 + s2, s1 + s3, C: the same | B, D] */
            __m256 x = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
            __m256 v = _mm256_mul_ps(_mm256_hadd_ps(x, x), _mm256_set1_ps(scale));   /* [A, C, . , . | B, D, . , .] */
            float r[8];
            _mm256_storeu_ps(r, v);
            out[j] = r[0]; out[j + 1] = r[4]; out[j + 2] = r[1]; out[j + 3] = r[5];
        }
    }
#endif
    for (; j < nk; j++) dots_keys_one(q, k[j], n, scale, out + j);
}

/* The largest of a tile's n scores (-inf for none), and the sum of its n softmax
 * weights: vectors along the tile (the tail filled with -inf / 0), then their
 * lanes reduced pairwise; the decode and the tree attention use both, so their
 * rows keep the same bits. (A sum in key order, one dependent addition a key,
 * cost a query as much as its scores.) */
static float tile_max(const float *v, int n) {
    int j = 0;
    float m = -INFINITY;
#if defined(SS_AVX512)
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; j < n; j += 16) {
        __mmask16 k = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, v + j));
    }
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; j < n; j++) m = v[j] > m ? v[j] : m;
    return m;
}

static float tile_sum(const float *v, int n) {
    int j = 0;
    float s = 0;
#if defined(SS_AVX512)
    __m512 sv = _mm512_setzero_ps();
    for (; j < n; j += 16) {
        __mmask16 k = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        sv = _mm512_add_ps(sv, _mm512_maskz_loadu_ps(k, v + j));
    }
    __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(sv), _mm512_extractf32x8_ps(sv, 1));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    float t[4];
    _mm_storeu_ps(t, s4);
    s = (t[0] + t[2]) + (t[1] + t[3]);
#elif defined(__AVX2__)
    __m256 sv = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) sv = _mm256_add_ps(sv, _mm256_loadu_ps(v + j));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sv), _mm256_extractf128_ps(sv, 1));
    float t[4];
    _mm_storeu_ps(t, s4);
    s = (t[0] + t[2]) + (t[1] + t[3]);
#endif
    for (; j < n; j++) s += v[j];
    return s;
}

/* acc[e] += p[j] * v[j][e] for a tile's keys j in order (the softmax weights
 * times the V rows; a weight of 0, a masked key or one that underflowed, adds
 * nothing): each element's sum in key order by fused multiply-adds, the same in
 * the decode and the tree attention. Vectors run along the head dim, four
 * registers at a time, so four chains of additions overlap. */
#if defined(SS_AVX512)
#define PV_W 16
#define PV_VEC __m512
#define PV_LOAD _mm512_loadu_ps
#define PV_STORE _mm512_storeu_ps
#define PV_SET1 _mm512_set1_ps
#define PV_FMA _mm512_fmadd_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define PV_W 8
#define PV_VEC __m256
#define PV_LOAD _mm256_loadu_ps
#define PV_STORE _mm256_storeu_ps
#define PV_SET1 _mm256_set1_ps
#define PV_FMA _mm256_fmadd_ps
#endif
static void pv_tile(const float *p, const float *const *v, int nt, int64_t hd, float *acc) {
    int64_t e = 0;
#if defined(PV_W)
    for (; e + 4 * PV_W <= hd; e += 4 * PV_W) {
        PV_VEC r[4];
        for (int u = 0; u < 4; u++) r[u] = PV_LOAD(acc + e + u * PV_W);
        for (int j = 0; j < nt; j++) {
            if (p[j] == 0) continue;
            PV_VEC w = PV_SET1(p[j]);
            for (int u = 0; u < 4; u++) r[u] = PV_FMA(w, PV_LOAD(v[j] + e + u * PV_W), r[u]);
        }
        for (int u = 0; u < 4; u++) PV_STORE(acc + e + u * PV_W, r[u]);
    }
    for (; e + PV_W <= hd; e += PV_W) {
        PV_VEC r = PV_LOAD(acc + e);
        for (int j = 0; j < nt; j++)
            if (p[j] != 0) r = PV_FMA(PV_SET1(p[j]), PV_LOAD(v[j] + e), r);
        PV_STORE(acc + e, r);
    }
#endif
    for (; e < hd; e++)
        for (int j = 0; j < nt; j++) {
            if (p[j] == 0) continue;
#if defined(__FMA__) || defined(SS_AVX512)
            acc[e] = fmaf(p[j], v[j][e], acc[e]);
#else
            acc[e] += p[j] * v[j][e];
#endif
        }
}

/* exp(x) for any x (the SiLU's exp(-g), the softmax's weights): Cephes' expf
 * polynomial (within 2 ulp of expf) over the range where a float's exp is
 * finite and normal (to 88.3, where 2^127 still holds the power of two), 0
 * below it, inf above. Plain arithmetic the compiler
 * vectorizes, so a row of activations costs a few instructions an element
 * instead of a libm call each (the default model's 30 MLPs, a 2-core Xeon: 0.16
 * -> 0.03 ms a one-token step, 0.68 -> 0.14 ms a 4-token one). Every row runs
 * the same loop, so an element's bits do not depend on how many rows a step
 * brings. */
static inline float exp_any(float v) {
    float x = v < -87.3f ? -87.3f : (v > 88.3f ? 88.3f : v);
    float fx = rintf(x * 1.44269504088896341f);
    float r = x - fx * 0.693359375f + fx * 2.12194440e-4f;
    float z = r * r;
    float y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r
                + 4.1665795894e-2f) * r + 1.6666665459e-1f) * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    int32_t bits = ((int32_t)fx + 127) << 23;
    float p2; memcpy(&p2, &bits, 4);
    return v < -87.3f ? 0.0f : (v > 88.3f ? INFINITY : y * p2);
}

/* v[j] = exp(v[j]) in place (softmax weights: scores minus their max, -inf
 * giving 0; a libm call a score cost as much as the score itself). */
static void exp_tile(float *v, int n) {
    for (int j = 0; j < n; j++) v[j] = exp_any(v[j]);
}

/* act[j] = silu(g[j]) * u[j] = g / (1 + exp(-g)) * u for n elements */
static void silu_mul(const float *g, const float *u, int64_t n, float *act) {
    for (int64_t j = 0; j < n; j++) act[j] = g[j] / (1.0f + exp_any(-g[j])) * u[j];
}

/* ---- the thread pool --------------------------------------------------- */
#define MAX_THREADS 256
typedef void (*chunk_fn)(void *args, int64_t chunk);
static struct {
    chunk_fn fn; void *args; int64_t n_chunks;
    _Atomic uint64_t ticket;     /* generation << 32 | next chunk */
    _Atomic int64_t done;
    _Atomic int sleeping;
    _Atomic int stop;
    int n_workers;
    pthread_t threads[MAX_THREADS];
    pthread_mutex_t mu; pthread_cond_t cv;
} P = { .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER };

static int claim(uint32_t gen, int64_t n) {
    uint64_t t = atomic_load_explicit(&P.ticket, memory_order_acquire);
    for (;;) {
        if ((uint32_t)(t >> 32) != gen || (int64_t)(t & 0xffffffffu) >= n) return -1;
        if (atomic_compare_exchange_weak_explicit(&P.ticket, &t, t + 1, memory_order_acq_rel, memory_order_acquire))
            return (int)(t & 0xffffffffu);
    }
}

/* Tests only (ss_pool_test_delay): microseconds a worker waits after seeing a new
 * job, and three times that the caller waits between writing a job and opening
 * it: the window of the race parallel_for closes, made wide. 0 in use. */
static int pool_test_delay_us = 0;

static void run_chunks(uint32_t gen) {
    chunk_fn fn = P.fn; void *args = P.args; int64_t n = P.n_chunks;
    /* orders the reads above before the claims' reads of the ticket: a field written
     * for a later job means the ticket shows a later generation (parallel_for) */
    atomic_thread_fence(memory_order_acquire);
    int c;
    while ((c = claim(gen, n)) >= 0) {
        fn(args, c);
        atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
    }
}

static double now_s(void) { struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts); return ts.tv_sec + 1e-9 * ts.tv_nsec; }

static void *worker(void *arg) {
    (void)arg;
    uint32_t seen = 0;
    while (!atomic_load(&P.stop)) {
        double t0 = now_s();
        uint32_t gen;
        int spins = 0;
        /* spin about 0.5 ms for the next job (the gap between two kernels of a step),
         * yielding the core now and then, then sleep until woken */
        while ((gen = (uint32_t)(atomic_load_explicit(&P.ticket, memory_order_acquire) >> 32)) == seen) {
            if (atomic_load(&P.stop)) return NULL;
            CPU_RELAX();
            if (++spins % 256 == 0) sched_yield();
            if (spins % 1024 == 0 && now_s() - t0 > 5e-4) {
                pthread_mutex_lock(&P.mu);
                atomic_fetch_add(&P.sleeping, 1);
                while ((uint32_t)(atomic_load(&P.ticket) >> 32) == seen && !atomic_load(&P.stop))
                    pthread_cond_wait(&P.cv, &P.mu);
                atomic_fetch_sub(&P.sleeping, 1);
                pthread_mutex_unlock(&P.mu);
            }
        }
        seen = gen;
        if (pool_test_delay_us) usleep(pool_test_delay_us);
        run_chunks(gen);
    }
    return NULL;
}

static uint32_t generation = 0;
/* One job at a time: a second caller thread runs its job alone. */
static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER;

static void parallel_for(chunk_fn fn, void *args, int64_t n_chunks) {
    if (P.n_workers == 0 || n_chunks <= 1 || pthread_mutex_trylock(&busy) != 0) {
        for (int64_t c = 0; c < n_chunks; c++) fn(args, c);
        return;
    }
    /* Close the last job's generation before its fields change. A worker that saw
     * that generation late reads the fields whenever it runs again; with the
     * generation still open it could read this job's fields (a larger n_chunks)
     * and still claim under the old generation: run a chunk of this job before it
     * opens, with an old function on new arguments or the other way round, and
     * count it in a `done` this job has reset (the caller then returns with a chunk
     * still running on its stack's arguments: crashes seen as SIGSEGV and SIGFPE).
     * A closed generation has nothing left to claim (count 0xffffffff). */
    uint32_t closed = ++generation;
    atomic_store_explicit(&P.ticket, ((uint64_t)closed << 32) | 0xffffffffu, memory_order_seq_cst);
    atomic_thread_fence(memory_order_seq_cst);
    P.fn = fn; P.args = args; P.n_chunks = n_chunks;
    atomic_store_explicit(&P.done, 0, memory_order_relaxed);
    if (pool_test_delay_us) usleep(3 * pool_test_delay_us);
    uint32_t gen = ++generation;
    atomic_store_explicit(&P.ticket, (uint64_t)gen << 32, memory_order_release);
    if (atomic_load(&P.sleeping)) {
        pthread_mutex_lock(&P.mu); pthread_cond_broadcast(&P.cv); pthread_mutex_unlock(&P.mu);
    }
    run_chunks(gen);
    /* every chunk is claimed now; wait for those still running elsewhere */
    /* a chunk still running belongs to a thread that may have lost its core: let it have ours */
    for (int spins = 0; atomic_load_explicit(&P.done, memory_order_acquire) < n_chunks; spins++) {
        CPU_RELAX();
        if (spins % 64 == 63) sched_yield();
    }
    pthread_mutex_unlock(&busy);
}

/* A forked child has none of the workers: it runs alone until set_threads. */
static void after_fork_child(void) {
    P.n_workers = 0;
    pthread_mutex_init(&busy, NULL); pthread_mutex_init(&P.mu, NULL); pthread_cond_init(&P.cv, NULL);
}
__attribute__((constructor)) static void register_fork_handler(void) { pthread_atfork(NULL, NULL, after_fork_child); }

static void stop_workers(void) {
    if (!P.n_workers) return;
    atomic_store(&P.stop, 1);
    pthread_mutex_lock(&P.mu); pthread_cond_broadcast(&P.cv); pthread_mutex_unlock(&P.mu);
    for (int i = 0; i < P.n_workers; i++) pthread_join(P.threads[i], NULL);
    P.n_workers = 0;
    atomic_store(&P.stop, 0);
}

/* n_threads counts the calling thread. */
int ss_set_threads(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    if (n_threads - 1 == P.n_workers) return n_threads;
    stop_workers();
    generation = (uint32_t)(atomic_load(&P.ticket) >> 32);
    for (int i = 0; i < n_threads - 1; i++) {
        if (pthread_create(&P.threads[i], NULL, worker, NULL) != 0) break;
        P.n_workers++;
    }
    return P.n_workers + 1;
}

int ss_get_threads(void) { return P.n_workers + 1; }

void ss_pool_test_delay(int us) { pool_test_delay_us = us < 0 ? 0 : us; }

/* ---- Q4 weights repacked for 16 rows at a time ---------------------------- */
#include "cpu_q4x16.c"
#include "cpu_q8x16.c"
#include "cpu_amx.c"

/* ---- matmul ------------------------------------------------------------ */
/* Rows of x meet each weight row four at a time while its blocks are in registers
 * (dotn_q: the nibbles unpacked once per four products), or sixteen weight rows
 * at a time in the repacked layouts (x16_group, x16_q8_group, amx_group). Either
 * way every output is one row of x against one row of W, its sums in an order
 * that does not depend on the other rows of x: a token's products come out the
 * same whatever else is in the step. */
#define MAX_SEG 8
#define M_BLOCK 64
typedef struct {
    int n_seg; int type[MAX_SEG]; const uint8_t *w[MAX_SEG]; int64_t rows[MAX_SEG];
    int64_t cols, m, ldy, chunk_rows, total_rows;
    const float *x; const int8_t *xq; const float *xd, *xs; float *y;
} mm_args;

static int int8_path(int t) { return t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0 || t == T_Q4X16 || t == T_Q8X16; }

static void mm_rows(mm_args *a, int s, int64_t base, int64_t lo, int64_t hi, float *rowbuf) {
    int t = a->type[s], qk = block_elems(t), bb = block_bytes(t);
    int64_t nb = a->cols / qk, row_bytes = nb * bb, nbx = a->cols / 32;
    if (t == T_Q4X16 || t == T_Q8X16) {   /* lo - base and hi - base are multiples of 16 */
#if defined(SS_AMX)
        /* (A twin of the loop below, stepping 16 rows of x: one loop with a variable
         * step measured 8% slower at 4-8 rows, so the AVX-512 loop keeps its own.) */
        if (amx_takes(a->m, t == T_Q8X16)) {   /* up to 16 rows of x a tile product (cpu_amx.c) */
            for (int64_t i0 = 0; i0 < a->m; i0 += M_BLOCK) {
                int64_t i1 = i0 + M_BLOCK < a->m ? i0 + M_BLOCK : a->m;
                for (int64_t r = lo; r < hi; r += 16)
                    for (int64_t i = i0; i < i1; i += AMX_MAX_M) {
                        int nx = i1 - i < AMX_MAX_M ? (int)(i1 - i) : AMX_MAX_M;
                        const uint8_t *w = a->w[s] + (r - base) * row_bytes;
                        const uint8_t *pf = i == i0 ? w + PF_AHEAD : w + 16 * row_bytes;
                        float *y = a->y + i * a->ldy + r;
                        if (amx_takes(nx, t == T_Q8X16)) {
                            amx_group(t == T_Q8X16, w, nb, a->xq + i * a->cols, a->cols, a->xd + i * nbx,
                                      a->xs + i * nbx, nx, y, a->ldy, pf);
                        } else {                 /* a tail of fewer rows */
                            for (int k0 = 0; k0 < nx; k0 += 4) {
                                qx_t xq[4]; int n4 = nx - k0 < 4 ? nx - k0 : 4;
                                for (int k = 0; k < n4; k++) {
                                    int64_t row = i + k0 + k;
                                    xq[k].q = a->xq + row * a->cols; xq[k].d = a->xd + row * nbx; xq[k].s = a->xs + row * nbx;
                                }
                                if (t == T_Q4X16) x16_group(w, nb, xq, n4, y + k0 * a->ldy, a->ldy, pf);
                                else x16_q8_group(w, nb, xq, n4, y + k0 * a->ldy, a->ldy, pf);
                            }
                        }
                    }
            }
            return;
        }
#endif
        for (int64_t i0 = 0; i0 < a->m; i0 += M_BLOCK) {
            int64_t i1 = i0 + M_BLOCK < a->m ? i0 + M_BLOCK : a->m;
            for (int64_t r = lo; r < hi; r += 16)
                for (int64_t i = i0; i < i1; i += 4) {
                    qx_t xq[4]; int nx = i1 - i < 4 ? (int)(i1 - i) : 4;
                    for (int k = 0; k < nx; k++) {
                        xq[k].q = a->xq + (i + k) * a->cols; xq[k].d = a->xd + (i + k) * nbx; xq[k].s = a->xs + (i + k) * nbx;
                    }
                    /* the first pass over the group streams it (prefetching ahead), the
                     * others read it from cache and prefetch the next group meanwhile, so
                     * memory keeps streaming while several rows of x are computed */
                    const uint8_t *w = a->w[s] + (r - base) * row_bytes;
                    const uint8_t *pf = i == i0 ? w + PF_AHEAD : w + 16 * row_bytes;
                    if (t == T_Q4X16) x16_group(w, nb, xq, nx, a->y + i * a->ldy + r, a->ldy, pf);
                    else x16_q8_group(w, nb, xq, nx, a->y + i * a->ldy + r, a->ldy, pf);
                }
        }
        return;
    }
    for (int64_t i0 = 0; i0 < a->m; i0 += M_BLOCK) {
        int64_t i1 = i0 + M_BLOCK < a->m ? i0 + M_BLOCK : a->m;
        for (int64_t r = lo; r < hi; r++) {
            const uint8_t *w = a->w[s] + (r - base) * row_bytes;
            if (int8_path(t)) {
                for (int64_t i = i0; i < i1; ) {
                    qx_t xq[4]; int nx = i1 - i < 4 ? (int)(i1 - i) : 4;
                    for (int k = 0; k < nx; k++) {
                        xq[k].q = a->xq + (i + k) * a->cols; xq[k].d = a->xd + (i + k) * nbx; xq[k].s = a->xs + (i + k) * nbx;
                    }
                    float v[4];
                    dotn_q(t, w, xq, nx, nb, v);
                    for (int k = 0; k < nx; k++) a->y[(i + k) * a->ldy + r] = v[k];
                    i += nx;
                }
            } else {   /* other formats: dequantize the row once, then fp32 dots */
                const float *wf = (const float *)w;
                if (t != T_F32) {
                    for (int64_t b = 0; b < nb; b++) dequant_block(t, w + b * bb, rowbuf + b * qk);
                    wf = rowbuf;
                }
                for (int64_t i = i0; i < i1; i++) a->y[i * a->ldy + r] = dot_f(wf, a->x + i * a->cols, a->cols);
            }
        }
    }
}

static void mm_chunk(void *a_, int64_t c) {
    mm_args *a = a_;
    int64_t r0 = c * a->chunk_rows, r1 = r0 + a->chunk_rows;
    if (r1 > a->total_rows) r1 = a->total_rows;
    float stackbuf[4096], *rowbuf = stackbuf;
    if (a->cols > 4096) rowbuf = malloc(a->cols * sizeof(float));
    int64_t base = 0;
    for (int s = 0; s < a->n_seg; base += a->rows[s], s++) {
        int64_t lo = r0 > base ? r0 : base, hi = r1 < base + a->rows[s] ? r1 : base + a->rows[s];
        if (lo < hi) mm_rows(a, s, base, lo, hi, rowbuf);
    }
#if defined(SS_AMX)
    amx_done();
#endif
    if (rowbuf != stackbuf) free(rowbuf);
}

/* y[i, r] (row stride ldy) = sum_k x[i, k] * W[r, k] for the m rows of x.
 * Returns 0, or -1 on an unsupported format or shape. */
int ss_matmul(int n_seg, const int *types, const uint8_t *const *ws, const int64_t *rows,
              int64_t cols, const float *x, int64_t m, float *y, int64_t ldy) {
    if (n_seg < 1 || n_seg > MAX_SEG || m < 1) return -1;
    mm_args a = { .n_seg = n_seg, .cols = cols, .m = m, .ldy = ldy, .x = x, .y = y };
    int64_t total = 0;
    int need_xq = 0;
    for (int s = 0; s < n_seg; s++) {
        if (!ss_supported(types[s]) || cols % block_elems(types[s])) return -1;
        if ((types[s] == T_Q4X16 || types[s] == T_Q8X16) && (rows[s] % 16 || total % 16)) return -1;
        a.type[s] = types[s]; a.w[s] = ws[s]; a.rows[s] = rows[s]; total += rows[s];
        need_xq |= int8_path(types[s]);
    }
    /* int8 copies of x for the 32-block formats */
    int8_t xq_stack[4 * 2048]; float xd_stack[4 * 64], xs_stack[4 * 64];
    int8_t *xq = xq_stack; float *xd = xd_stack, *xs = xs_stack; void *heap = NULL;
    if (need_xq && m * cols > 4 * 2048) {
        heap = malloc(m * cols + 64 + 2 * sizeof(float) * (m * cols / 32 + 1));
        if (!heap) return -1;
        xq = heap; xd = (float *)((char *)heap + ((m * cols + 63) & ~63)); xs = xd + m * cols / 32;
    }
    if (need_xq)
        for (int64_t i = 0; i < m; i++)
            quantize_x(x + i * cols, cols, xq + i * cols, xd + i * (cols / 32), xs + i * (cols / 32));
    a.xq = xq; a.xd = xd; a.xs = xs; a.total_rows = total;
    /* ~4 chunks a thread: enough that a late thread costs little, long enough that
     * each thread streams its weights in runs the prefetchers follow (16 chunks a
     * thread, interleaved between threads, made 2-thread decode products ~1.5x slower) */
    int64_t nt = P.n_workers + 1, chunk = total / (4 * nt);
    chunk = chunk < 16 ? 16 : chunk / 16 * 16;   /* whole groups of a repacked segment */
    a.chunk_rows = chunk;
    parallel_for(mm_chunk, &a, (total + chunk - 1) / chunk);
    free(heap);
    return 0;
}

/* ---- greedy choice ------------------------------------------------------ */
/* out[i] = the first index of the largest value of row i of x [rows, n] (a NaN
 * counts as largest, as in torch's argmax): the row's maximum as vectors, then
 * the first position equal to it. One thread: a row of logits just written by
 * the LM head's threads costs less to read here than to hand out again. */
int ss_row_argmax(const float *x, int64_t rows, int64_t n, int64_t *out) {
    if (rows < 0 || n < 1) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        int64_t j = 0, hit = -1;
        float m = -INFINITY;
#if defined(SS_AVX512)
        __m512 mv = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (; j + 16 <= n; j += 16) {
            __m512 a = _mm512_loadu_ps(v + j);
            nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            mv = _mm512_max_ps(mv, a);
        }
        m = _mm512_reduce_max_ps(mv);
        if (nan) j = 0, m = -INFINITY;       /* a NaN somewhere: the scalar scan finds the first */
#endif
        for (; j < n && hit < 0; j++) {
            if (v[j] != v[j]) hit = j;
            else m = v[j] > m ? v[j] : m;
        }
        if (hit >= 0) { out[r] = hit; continue; }
        int64_t k = 0;
#if defined(SS_AVX512)
        const __m512 mm = _mm512_set1_ps(m);
        for (; k + 16 <= n && hit < 0; k += 16) {
            __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + k), mm, _CMP_EQ_OQ);
            if (eq) hit = k + __builtin_ctz(eq);
        }
#endif
        for (; k < n && hit < 0; k++) if (v[k] == m) hit = k;
        out[r] = hit;
    }
    return 0;
}

/* ---- sampling candidates ----------------------------------------------- */
/* Row r of x [rows, n] (logits after the temperature: finite or -inf, no NaN):
 * lse[r] = log(sum_j exp(x[j])) (-inf for a row of -inf), and its candidates, the
 * columns j with x[j] >= max - d in column order, for the widest d of delta,
 * delta / 1.5, delta / 2.4 and delta / 4 that leaves at most cap of them: into
 * ids[r * cap ..], their number into count[r] (more than cap where even the
 * narrowest d leaves more; then ids holds the first cap). Top-k and top-p then look
 * among the candidates instead of sorting the row (a sort of a 49k row took ~2 ms
 * on a 2-core Xeon, torch's topk of 256 ~0.15 ms). The sum runs over 16 lanes
 * with the vectorized exp; blocks of 16 without a candidate cost a compare
 * (AVX-512) or the scalar scan. */
int ss_row_candidates(const float *x, int64_t rows, int64_t n, float delta, int64_t cap,
                      int64_t *ids, float *lse, int64_t *count) {
    if (rows < 0 || n < 1 || cap < 1) return -1;
    const float frac[4] = {1.0f, 1.0f / 1.5f, 1.0f / 2.4f, 0.25f};
    for (int64_t r = 0; r < rows; r++) {
        const float *v = x + r * n;
        float m = -INFINITY;
        int64_t j = 0;
#if defined(SS_AVX512)
        __m512 mv = _mm512_set1_ps(-INFINITY);
        for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(v + j));
        m = _mm512_reduce_max_ps(mv);
#endif
        for (; j < n; j++) m = v[j] > m ? v[j] : m;
        count[r] = 0;
        if (m == -INFINITY) { lse[r] = -INFINITY; continue; }
        float lane[16] = {0};
        for (j = 0; j + 16 <= n; j += 16)
            for (int i = 0; i < 16; i++) lane[i] += exp_any(v[j + i] - m);
        double sum = 0;
        for (int i = 0; i < 16; i++) sum += lane[i];
        for (; j < n; j++) sum += exp_any(v[j] - m);
        lse[r] = m + (float)log(sum);
        /* how many each threshold keeps, then the widest that fits */
        float thr[4];
        int64_t kept[4] = {0, 0, 0, 0};
        for (int t = 0; t < 4; t++) thr[t] = m - delta * frac[t];
        j = 0;
#if defined(SS_AVX512)
        const __m512 t0 = _mm512_set1_ps(thr[0]);
        for (; j + 16 <= n; j += 16) {
            __m512 a = _mm512_loadu_ps(v + j);
            if (!_mm512_cmp_ps_mask(a, t0, _CMP_GE_OQ)) continue;
            for (int t = 0; t < 4; t++)
                kept[t] += __builtin_popcount(_mm512_cmp_ps_mask(a, _mm512_set1_ps(thr[t]), _CMP_GE_OQ));
        }
#endif
        for (; j < n; j++)
            for (int t = 0; t < 4; t++) kept[t] += v[j] >= thr[t];
        int t = 0;
        while (t < 3 && kept[t] > cap) t++;
        const float th = thr[t];
        int64_t c = 0, *out = ids + r * cap;
        j = 0;
#if defined(SS_AVX512)
        const __m512 tv = _mm512_set1_ps(th);
        for (; j + 16 <= n; j += 16) {
            __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + j), tv, _CMP_GE_OQ);
            while (hit) {
                int b = __builtin_ctz(hit);
                if (c < cap) out[c] = j + b;
                c++;
                hit &= hit - 1;
            }
        }
#endif
        for (; j < n; j++)
            if (v[j] >= th) { if (c < cap) out[c] = j; c++; }
        count[r] = c;
    }
    return 0;
}

/* ---- dequantization and row lookup ------------------------------------ */
typedef struct { int type; const uint8_t *w; int64_t cols; const int64_t *ids; float *out; int64_t chunk, n; } dq_args;

static void dequant_row(int t, const uint8_t *w, int64_t cols, float *out) {
    int qk = block_elems(t), bb = block_bytes(t);
    for (int64_t b = 0; b < cols / qk; b++) dequant_block(t, w + b * bb, out + b * qk);
}

static void dq_chunk(void *a_, int64_t c) {
    dq_args *a = a_;
    int64_t row_bytes = a->cols / block_elems(a->type) * block_bytes(a->type);
    for (int64_t i = c * a->chunk; i < (c + 1) * a->chunk && i < a->n; i++) {
        int64_t r = a->ids ? a->ids[i] : i;
        if (a->type == T_Q4X16) x16_dequant_row(a->w, r, a->cols / 32, a->out + i * a->cols);
        else if (a->type == T_Q8X16) x16_q8_dequant_row(a->w, r, a->cols / 32, a->out + i * a->cols);
        else dequant_row(a->type, a->w + r * row_bytes, a->cols, a->out + i * a->cols);
    }
}

int ss_dequant(int type, const uint8_t *w, int64_t rows, int64_t cols, float *out) {
    if (!ss_supported(type) || cols % block_elems(type)) return -1;
    dq_args a = { type, w, cols, NULL, out, (rows + 63) / 64, rows };
    parallel_for(dq_chunk, &a, (rows + a.chunk - 1) / a.chunk);
    return 0;
}

/* out[i] = dequantized row ids[i]; ids are checked by the caller. */
int ss_get_rows(int type, const uint8_t *w, int64_t cols, const int64_t *ids, int64_t n, float *out) {
    if (!ss_supported(type) || cols % block_elems(type)) return -1;
    dq_args a = { type, w, cols, ids, out, 1, n };
    if (n < 64) { for (int64_t i = 0; i < n; i++) dq_chunk(&a, i); return 0; }
    parallel_for(dq_chunk, &a, n);
    return 0;
}

/* ---- decode attention over the paged cache ----------------------------- */
/* q [num_seqs, num_heads, head_dim] fp32; caches [num_blocks, block_size,
 * num_kv_heads, head_dim] fp32 (kv_bf16 = 0) or bf16 (1); block_tables
 * [num_seqs, table_stride] int32; out like q. The query of sequence s sits at
 * position seq_lens[s] - 1 and sees keys max(0, seq_len - window) .. seq_len - 1. */
/* A KIVI cache (slipstream/cache/kivi_paged.py): the caches above are then its
 * window pool [slots, block_size, nkv, hd], and block b's rows are in slot
 * win_of[b] when that is >= 0, else sealed as codes: keys per channel,
 * k_codes [blocks, nkv, hd, bs / per] (token t of a channel at byte t / per, bits
 * (t % per) * bits), k_scale / k_zero [blocks, nkv, hd] fp16; values per token,
 * v_codes [blocks, bs, nkv, hd / per], v_scale / v_zero [blocks, bs, nkv, hd / cg]
 * fp16; x = code * scale + zero. */
typedef struct {
    const uint8_t *k_codes, *k_scale, *k_zero, *v_codes, *v_scale, *v_zero;
    const int32_t *win_of;
    int32_t bits, cg;
} ss_kivi_t;

typedef struct {
    const float *q; int64_t q_stride; const void *kc, *vc; int kv_bf16;
    const int32_t *tables; int64_t table_stride; const int32_t *seq_lens;
    int nh, nkv, hd, bs; float scale; int64_t window; float *out; int gsz;
    const ss_kivi_t *kivi;   /* NULL: a plain paged cache */
} attn_args;

static inline void load_row(const void *base, int bf16, int64_t off, int hd, float *dst) {
    if (bf16) { const uint16_t *p = (const uint16_t *)base + off; for (int i = 0; i < hd; i++) dst[i] = bf2f(p[i]); }
    else memcpy(dst, (const float *)base + off, hd * sizeof(float));
}

/* A sealed block's key scales and zeros as floats (the block last converted). */
typedef struct { int64_t blk; float s[512], z[512]; } kivi_scales_t;

/* Key (v = 0) or value (v = 1) row tt of cache block blk (a block table's entry)
 * for KV head kvh: a pointer into the cache, or the row dequantized into buf
 * (ks: the key scales of the block last read, kept between calls). */
static const float *kv_row(const attn_args *a, int v, int64_t blk, int64_t tt, int kvh, float *buf,
                           kivi_scales_t *ks) {
    int64_t hd = a->hd;
    const ss_kivi_t *kv = a->kivi;
    if (kv && kv->win_of[blk] < 0) {
        int bits = kv->bits, per = 8 / bits, mask = (1 << bits) - 1;
        if (!v) {
            int64_t stride = a->bs / per;
            if (ks->blk != blk) {
                const uint8_t *s = kv->k_scale + 2 * (blk * a->nkv + kvh) * hd;
                const uint8_t *z = kv->k_zero + 2 * (blk * a->nkv + kvh) * hd;
                for (int64_t i = 0; i < hd; i++) { ks->s[i] = h2f(s + 2 * i); ks->z[i] = h2f(z + 2 * i); }
                ks->blk = blk;
            }
            const uint8_t *c = kv->k_codes + ((blk * a->nkv + kvh) * hd) * stride + tt / per;
            int sh = (int)(tt % per) * bits;
            for (int64_t i = 0; i < hd; i++)
                buf[i] = (float)((c[i * stride] >> sh) & mask) * ks->s[i] + ks->z[i];
        } else {
            int64_t row = (blk * a->bs + tt) * a->nkv + kvh, cg = kv->cg;
            const uint8_t *c = kv->v_codes + row * (hd / per);
            const uint8_t *s = kv->v_scale + 2 * row * (hd / cg), *z = kv->v_zero + 2 * row * (hd / cg);
            for (int64_t g = 0; g < hd / cg; g++) {
                float sg = h2f(s + 2 * g), zg = h2f(z + 2 * g);
                for (int64_t i = g * cg; i < (g + 1) * cg; i += per) {
                    unsigned byte = c[i / per];
                    for (int j = 0; j < per; j++) buf[i + j] = (float)((byte >> (j * bits)) & mask) * sg + zg;
                }
            }
        }
        return buf;
    }
    if (kv) blk = kv->win_of[blk];
    int64_t off = ((blk * a->bs + tt) * a->nkv + kvh) * hd;
    const void *base = v ? a->vc : a->kc;
    if (a->kv_bf16) { load_row(base, 1, off, (int)hd, buf); return buf; }
    return (const float *)base + off;   /* fp32 rows: in place */
}

/* Chunk c: sequence s, KV head kvh, and a group of gsz of the query heads that
 * share it (each K/V row is read or converted once for the group). Keys go in
 * tiles of 64: the tile's scores, then the running max, denominator and
 * accumulators are rescaled once a tile (not once a key), then the tile's V rows
 * are added, a query at a time (pv_tile). Rows
 * are found by stepping through the block table (a division a row cost as much
 * as the row's products). */
#define ATT_TILE 64
#define ATT_GROUP 8
static void attn_chunk(void *a_, int64_t c) {
    attn_args *a = a_;
    int G = a->nh / a->nkv, parts = (G + a->gsz - 1) / a->gsz, hd = a->hd;
    int64_t s = c / ((int64_t)a->nkv * parts);
    int kvh = (int)(c / parts % a->nkv), h0 = kvh * G + (int)(c % parts) * a->gsz;
    int ng = h0 + a->gsz <= (kvh + 1) * G ? a->gsz : (kvh + 1) * G - h0;
    int64_t n = a->seq_lens[s], lo = a->window > 0 && n > a->window ? n - a->window : 0;
    const int32_t *table = a->tables + s * a->table_stride;
    const float *q[ATT_GROUP];
    float acc[ATT_GROUP][512], sc[ATT_GROUP][ATT_TILE], mx[ATT_GROUP], den[ATT_GROUP];
    float kbuf[a->kv_bf16 || a->kivi ? ATT_TILE * hd : 1];   /* a tile's converted K and V rows */
    float vbuf[a->kv_bf16 || a->kivi ? ATT_TILE * hd : 1];
    const float *kp[ATT_TILE], *vp[ATT_TILE];
    kivi_scales_t kscales;
    kscales.blk = -1;
    for (int g = 0; g < ng; g++) {
        q[g] = a->q + s * a->q_stride + (int64_t)(h0 + g) * hd;
        mx[g] = -INFINITY; den[g] = 0;
        for (int i = 0; i < hd; i++) acc[g][i] = 0;
    }
    for (int64_t t0 = lo; t0 < n; t0 += ATT_TILE) {
        int nt = n - t0 < ATT_TILE ? (int)(n - t0) : ATT_TILE;
        int64_t tb = t0 / a->bs, tt = t0 % a->bs;
        for (int j = 0; j < nt; j++) {
            kp[j] = kv_row(a, 0, table[tb], tt, kvh, kbuf + j * hd, &kscales);
            vp[j] = kv_row(a, 1, table[tb], tt, kvh, vbuf + j * hd, &kscales);
            if (++tt == a->bs) { tt = 0; tb++; }
        }
        for (int g = 0; g < ng; g++) dots_keys(q[g], kp, nt, hd, a->scale, sc[g]);
        for (int g = 0; g < ng; g++) {
            float m = tile_max(sc[g], nt);
            m = m > mx[g] ? m : mx[g];
            if (m > mx[g]) {
                float f = expf(mx[g] - m);   /* 0 on the first tile */
                den[g] *= f;
                for (int i = 0; i < hd; i++) acc[g][i] *= f;
                mx[g] = m;
            }
            for (int j = 0; j < nt; j++) sc[g][j] -= m;
            exp_tile(sc[g], nt);
            den[g] += tile_sum(sc[g], nt);
        }
        for (int g = 0; g < ng; g++) pv_tile(sc[g], vp, nt, hd, acc[g]);
    }
    for (int g = 0; g < ng; g++) {
        float *o = a->out + (s * a->nh + h0 + g) * hd;
        for (int i = 0; i < hd; i++) o[i] = acc[g][i] / den[g];
    }
}

static inline uint16_t f2bf(float f) {   /* round to nearest even, as torch does */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 64);   /* NaN stays NaN */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static void store_row(void *cache, int bf16, int64_t off, const float *src, int64_t n) {
    if (bf16) { uint16_t *p = (uint16_t *)cache + off; for (int64_t i = 0; i < n; i++) p[i] = f2bf(src[i]); }
    else memcpy((float *)cache + off, src, n * sizeof(float));
}

/* q: token s's heads start at q + s * q_stride (heads contiguous). When k_new is
 * given, each sequence's new K/V (rows k_new + s * k_stride, v_new + s * v_stride,
 * kv heads contiguous) are first written to cache slot slots[s] (-1: skipped).
 * kivi: NULL, or the KIVI cache the caches are the window pool of (slots are then
 * window-pool slots). */
int ss_decode_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                        int kv_bf16, const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                        int64_t num_seqs, int nh, int nkv, int hd, int bs, float scale, int64_t window,
                        const float *k_new, int64_t k_stride, const float *v_new, int64_t v_stride,
                        const int64_t *slots, float *out, const ss_kivi_t *kivi) {
    if (hd > 512 || nkv < 1 || nh % nkv) return -1;
    if (k_new)
        for (int64_t s = 0; s < num_seqs; s++) {
            if (slots[s] < 0) continue;
            store_row((void *)k_cache, kv_bf16, slots[s] * nkv * hd, k_new + s * k_stride, (int64_t)nkv * hd);
            store_row((void *)v_cache, kv_bf16, slots[s] * nkv * hd, v_new + s * v_stride, (int64_t)nkv * hd);
        }
    if (kivi && (kivi->bits != 2 && kivi->bits != 4)) return -1;
    attn_args a = { q, q_stride, k_cache, v_cache, kv_bf16, tables, table_stride, seq_lens, nh, nkv, hd, bs, scale, window, out, 0, kivi };
    /* query heads per chunk: a whole GQA group (at most ATT_GROUP), halved only
     * while that leaves a thread without a chunk. Reading the K/V rows is most of a
     * chunk's time, and each chunk reads its KV head's rows: on the default model
     * (3 KV heads, 9 query heads, one sequence, 2 threads) chunks of one query head
     * made a step's attention twice as slow (0.75 against 0.37 ms over 30 layers) */
    int G = nh / nkv, gsz = G < ATT_GROUP ? G : ATT_GROUP;
    /* (not over KIVI codes: each chunk dequantizes its rows, so whole groups) */
    while (!kivi && gsz > 1 && num_seqs * nkv * ((G + gsz - 1) / gsz) < P.n_workers + 1) gsz = (gsz + 1) / 2;
    a.gsz = gsz;
    parallel_for(attn_chunk, &a, num_seqs * nkv * ((G + gsz - 1) / gsz));
    return 0;
}

/* ---- several tokens a sequence, under a tree mask --------------------------- */
#include "cpu_tree_attention.c"

/* ---- a whole decode step ------------------------------------------------ */
#include "cpu_decoder.c"
#include "cpu_eagle.c"
