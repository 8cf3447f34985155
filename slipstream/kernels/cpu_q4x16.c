/* Q4_0 / Q4_1 weights repacked at load for products with int8 activations
 * (included by cpu_quant.c).
 *
 * Layout "Q4x16": rows in groups of 16; for group g and 32-block b, 320 bytes
 * (as many as 16 Q4_1 blocks) at (g * nb + b) * 320:
 *   [0, 32)    d[16]  fp16, one scale per row
 *   [32, 64)   m[16]  fp16, one offset per row (Q4_0: m = -8 d, exact in fp16)
 *   [64, 320)  four 64-byte chunks j = 0..3; chunk j holds, for row r, the
 *              block's nibble bytes 4j..4j+3 at 4 r.
 * Byte i of a block holds element i (low nibble) and element i + 16 (high).
 * So a 32-bit lane r of a 512-bit register is row r: one dot-product
 * instruction (u8 x s8, 4 products a lane) with 4 bytes of x broadcast to
 * every lane advances 16 rows at once, and each row's scale and offset are
 * applied as vectors, once per block, with no horizontal sums:
 *   y[r] = sum_b d[r] dx[b] sum_k u[r, k] qx[b, k] + m[r] sx[b]
 * with (qx, dx, sx) the int8 block, scale and scaled sum of x, as elsewhere.
 */
#define T_Q4X16 100
typedef int32_t ss_i32u __attribute__((aligned(1), may_alias));   /* an unaligned int32 */
#define X16_BYTES 320
/* Software prefetch this far ahead in the weight stream (bytes): the hardware
 * prefetchers stop at 4 KiB boundaries; measured on the default model at 1
 * thread, all products of a decode step ~20% faster with it. */
#define PF_AHEAD 2048

/* fp16 bits of a float that fp16 holds exactly (no rounding needed) */
static uint16_t f2h_exact(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    uint16_t s = (uint16_t)((u >> 16) & 0x8000);
    int e = (int)((u >> 23) & 0xff) - 127 + 15;
    uint32_t m = u & 0x7fffff;
    if ((u & 0x7fffffff) == 0) return s;
    if (e >= 31) return s | 0x7c00;
    if (e <= 0) return e < -10 ? s : (uint16_t)(s | ((m | 0x800000) >> (14 - e)));
    return (uint16_t)(s | (e << 10) | (m >> 13));
}

/* src [rows, nb * bb] in Q4_0 or Q4_1 -> dst [rows / 16, nb, 320] */
static void repack_group(int t, const uint8_t *src, int64_t nb, uint8_t *dst) {
    int bb = t == T_Q4_1 ? 20 : 18, q0 = t == T_Q4_1 ? 4 : 2;
    for (int64_t b = 0; b < nb; b++, dst += X16_BYTES)
        for (int r = 0; r < 16; r++) {
            const uint8_t *blk = src + (r * nb + b) * bb;
            uint16_t d, m;
            memcpy(&d, blk, 2);
            if (t == T_Q4_1) memcpy(&m, blk + 2, 2);
            else m = f2h_exact(-8 * h2f(blk));
            memcpy(dst + 2 * r, &d, 2);
            memcpy(dst + 32 + 2 * r, &m, 2);
            for (int j = 0; j < 4; j++) memcpy(dst + 64 + 64 * j + 4 * r, blk + q0 + 4 * j, 4);
        }
}

typedef struct { int t; const uint8_t *src; int64_t nb; uint8_t *dst; } rp_args;
static void rp_chunk(void *a_, int64_t g) {
    rp_args *a = a_;
    int bb = a->t == T_Q4_1 ? 20 : 18;
    repack_group(a->t, a->src + g * 16 * a->nb * bb, a->nb, a->dst + g * a->nb * X16_BYTES);
}

/* Returns 0, or -1 when the format or shape does not repack (rows % 16, cols % 32). */
int ss_repack_q4x16(int t, const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    if ((t != T_Q4_0 && t != T_Q4_1) || rows % 16 || cols % 32) return -1;
    rp_args a = { t, src, cols / 32, dst };
    parallel_for(rp_chunk, &a, rows / 16);
    return 0;
}

/* y[i * ldy + r] for the 16 rows of group w (nb blocks) and nx (<= 4) rows of x. */
static void x16_group(const uint8_t *w, int64_t nb, const qx_t *x, int nx, float *y, int64_t ldy,
                         const uint8_t *pf) {   /* pf: prefetched along with w, block by block */
#if defined(SS_AVX512)
    const uint8_t *w0 = w;
    __m512 acc[4];
    for (int i = 0; i < nx; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++, w += X16_BYTES) {
        for (int l = 0; l < X16_BYTES; l += 64) _mm_prefetch((const char *)pf + (w - w0) + l, _MM_HINT_T0);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
        __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 32)));
        __m512i lo[4], hi[4];
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_loadu_si512(w + 64 + 64 * j);
            lo[j] = _mm512_and_si512(v, low);
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        for (int i = 0; i < nx; i++) {
            /* x's 4-byte groups broadcast straight from memory (a load-port
             * broadcast) instead of from a general register (a shuffle-port one,
             * the port the dot products' other work shares): 1.12-1.17x at 4-16
             * rows of x on a 2-core AVX-512 VNNI Xeon (the build without VNNI:
             * 1.08-1.17x), even at 1-2 */
            const ss_i32u *qv = (const ss_i32u *)(x[i].q + 32 * b);
            __m512i s = _mm512_setzero_si512();
#if defined(__AVX512VNNI__)
            for (int j = 0; j < 4; j++) {
                s = _mm512_dpbusd_epi32(s, lo[j], _mm512_set1_epi32(qv[j]));
                s = _mm512_dpbusd_epi32(s, hi[j], _mm512_set1_epi32(qv[4 + j]));
            }
#else
            const __m512i one = _mm512_set1_epi16(1);
            for (int j = 0; j < 4; j++) {
                __m512i p = _mm512_add_epi16(_mm512_maddubs_epi16(lo[j], _mm512_set1_epi32(qv[j])),
                                             _mm512_maddubs_epi16(hi[j], _mm512_set1_epi32(qv[4 + j])));
                s = _mm512_add_epi32(s, _mm512_madd_epi16(p, one));
            }
#endif
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(x[i].d[b])), acc[i]);
            acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[i].s[b]), acc[i]);
        }
    }
    for (int i = 0; i < nx; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
#elif defined(__AVX2__)
    for (int half = 0; half < 2; half++) {           /* rows 8 half .. 8 half + 7 */
        const uint8_t *p = w;
        __m256 acc[4];
        for (int i = 0; i < nx; i++) acc[i] = _mm256_setzero_ps();
        const __m256i low = _mm256_set1_epi8(15);
        for (int64_t b = 0; b < nb; b++, p += X16_BYTES) {
            if (half == 0)
                for (int l = 0; l < X16_BYTES; l += 64) _mm_prefetch((const char *)pf + (p - w) + l, _MM_HINT_T0);
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * half)));
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 32 + 16 * half)));
            __m256i lo[4], hi[4];
            for (int j = 0; j < 4; j++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(p + 64 + 64 * j + 32 * half));
                lo[j] = _mm256_and_si256(v, low);
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            for (int i = 0; i < nx; i++) {
                const ss_i32u *xv = (const ss_i32u *)(x[i].q + 32 * b);   /* see above */
                __m256i s = _mm256_setzero_si256();
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
                for (int j = 0; j < 4; j++) {
                    s = _mm256_dpbusd_avx_epi32(s, lo[j], _mm256_set1_epi32(xv[j]));
                    s = _mm256_dpbusd_avx_epi32(s, hi[j], _mm256_set1_epi32(xv[4 + j]));
                }
#else
                const __m256i one = _mm256_set1_epi16(1);
                for (int j = 0; j < 4; j++) {
                    __m256i q = _mm256_add_epi16(_mm256_maddubs_epi16(lo[j], _mm256_set1_epi32(xv[j])),
                                                 _mm256_maddubs_epi16(hi[j], _mm256_set1_epi32(xv[4 + j])));
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(q, one));
                }
#endif
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(x[i].d[b])), acc[i]);
                acc[i] = _mm256_fmadd_ps(m, _mm256_set1_ps(x[i].s[b]), acc[i]);
            }
        }
        for (int i = 0; i < nx; i++) _mm256_storeu_ps(y + i * ldy + 8 * half, acc[i]);
    }
#else
    (void)pf;
    float acc[4][16];
    memset(acc, 0, sizeof(acc));
    for (int64_t b = 0; b < nb; b++, w += X16_BYTES)
        for (int r = 0; r < 16; r++) {
            float d = h2f(w + 2 * r), m = h2f(w + 32 + 2 * r);
            for (int i = 0; i < nx; i++) {
                const int8_t *q = x[i].q + 32 * b;
                int s = 0;
                for (int j = 0; j < 4; j++)
                    for (int k = 0; k < 4; k++) {
                        uint8_t u = w[64 + 64 * j + 4 * r + k];
                        s += (u & 15) * q[4 * j + k] + (u >> 4) * q[16 + 4 * j + k];
                    }
                acc[i][r] += d * x[i].d[b] * s + m * x[i].s[b];
            }
        }
    for (int i = 0; i < nx; i++) memcpy(y + i * ldy, acc[i], sizeof(acc[i]));
#endif
}

/* One Q4x16 row of the weights dequantized (the row lookup and dequantization). */
static void x16_dequant_row(const uint8_t *seg, int64_t r, int64_t nb, float *out) {
    const uint8_t *w = seg + (r / 16) * nb * X16_BYTES;
    int l = (int)(r % 16);
    for (int64_t b = 0; b < nb; b++, w += X16_BYTES) {
        float d = h2f(w + 2 * l), m = h2f(w + 32 + 2 * l);
        for (int j = 0; j < 4; j++)
            for (int k = 0; k < 4; k++) {
                uint8_t u = w[64 + 64 * j + 4 * l + k];
                out[32 * b + 4 * j + k] = (u & 15) * d + m;
                out[32 * b + 16 + 4 * j + k] = (u >> 4) * d + m;
            }
    }
}
