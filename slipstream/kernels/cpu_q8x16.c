/* Q8_0 weights repacked at load for 16 rows at a time (included by
 * cpu_quant.c after cpu_q4x16.c; same idea, see there).
 *
 * Layout "Q8x16": rows in groups of 16; for group g and 32-block b, 544 bytes
 * (as many as 16 Q8_0 blocks) at (g * nb + b) * 544:
 *   [0, 32)    d[16] fp16, one scale per row
 *   [32, 544)  eight 64-byte chunks j = 0..7; chunk j holds, for row r, the
 *              block's values 4j..4j+3 at 4 r, stored as w + 128 (u8).
 * An unsigned-by-signed dot instruction then sums (w + 128) x, and
 *   y[r] = sum_b d[r] dx[b] (sum_k (w + 128) qx - 128 sum_k qx)
 *        = sum_b d[r] dx[b] sum_k (w + 128) qx - 128 d[r] sx[b].
 * Without VNNI (u8 x s8 pairs would saturate 16 bits) the values are turned
 * back to signed and multiplied as |w| * (x signed like w), as elsewhere.
 */
#define T_Q8X16 101
#define X8_BYTES 544

static void repack_q8_group(const uint8_t *src, int64_t nb, uint8_t *dst) {
    for (int64_t b = 0; b < nb; b++, dst += X8_BYTES)
        for (int r = 0; r < 16; r++) {
            const uint8_t *blk = src + (r * nb + b) * 34;
            memcpy(dst + 2 * r, blk, 2);
            for (int j = 0; j < 8; j++)
                for (int k = 0; k < 4; k++) dst[32 + 64 * j + 4 * r + k] = blk[2 + 4 * j + k] ^ 0x80;
        }
}

typedef struct { const uint8_t *src; int64_t nb; uint8_t *dst; } rp8_args;
static void rp8_chunk(void *a_, int64_t g) {
    rp8_args *a = a_;
    repack_q8_group(a->src + g * 16 * a->nb * 34, a->nb, a->dst + g * a->nb * X8_BYTES);
}

int ss_repack_q8x16(const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst) {
    if (rows % 16 || cols % 32) return -1;
    rp8_args a = { src, cols / 32, dst };
    parallel_for(rp8_chunk, &a, rows / 16);
    return 0;
}

static void x16_q8_group(const uint8_t *w, int64_t nb, const qx_t *x, int nx, float *y, int64_t ldy,
                         const uint8_t *pf) {   /* pf: prefetched along with w, block by block */
#if defined(SS_AVX512)
    const uint8_t *w0 = w;
    __m512 acc[4];
    for (int i = 0; i < nx; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++, w += X8_BYTES) {
        for (int l = 0; l < X8_BYTES; l += 64) _mm_prefetch((const char *)pf + (w - w0) + l, _MM_HINT_T0);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
        __m512i v[8];
        for (int j = 0; j < 8; j++) v[j] = _mm512_loadu_si512(w + 32 + 64 * j);
        for (int i = 0; i < nx; i++) {
            const ss_i32u *qv = (const ss_i32u *)(x[i].q + 32 * b);   /* see x16_group */
            __m512i s = _mm512_setzero_si512();
#if defined(__AVX512VNNI__)
            for (int j = 0; j < 8; j++) s = _mm512_dpbusd_epi32(s, v[j], _mm512_set1_epi32(qv[j]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(x[i].d[b])), acc[i]);
            acc[i] = _mm512_fmadd_ps(d, _mm512_set1_ps(-128 * x[i].s[b]), acc[i]);
#else
            const __m512i one = _mm512_set1_epi16(1), bias = _mm512_set1_epi8((char)0x80);
            for (int j = 0; j < 8; j++) {
                __m512i ws = _mm512_xor_si512(v[j], bias), xb = _mm512_set1_epi32(qv[j]);
                __mmask64 neg = _mm512_movepi8_mask(ws);
                __m512i xsg = _mm512_mask_sub_epi8(xb, neg, _mm512_setzero_si512(), xb);
                s = _mm512_add_epi32(s, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(ws), xsg), one));
            }
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(x[i].d[b])), acc[i]);
#endif
        }
    }
    for (int i = 0; i < nx; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
#elif defined(__AVX2__)
    for (int half = 0; half < 2; half++) {
        const uint8_t *p = w;
        __m256 acc[4];
        for (int i = 0; i < nx; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++, p += X8_BYTES) {
            if (half == 0)
                for (int l = 0; l < X8_BYTES; l += 64) _mm_prefetch((const char *)pf + (p - w) + l, _MM_HINT_T0);
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * half)));
            __m256i v[8];
            for (int j = 0; j < 8; j++) v[j] = _mm256_loadu_si256((const __m256i *)(p + 32 + 64 * j + 32 * half));
            for (int i = 0; i < nx; i++) {
                const ss_i32u *xv = (const ss_i32u *)(x[i].q + 32 * b);   /* see above */
                __m256i s = _mm256_setzero_si256();
#if defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
                for (int j = 0; j < 8; j++) s = _mm256_dpbusd_avx_epi32(s, v[j], _mm256_set1_epi32(xv[j]));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(x[i].d[b])), acc[i]);
                acc[i] = _mm256_fmadd_ps(d, _mm256_set1_ps(-128 * x[i].s[b]), acc[i]);
#else
                const __m256i one = _mm256_set1_epi16(1), bias = _mm256_set1_epi8((char)0x80);
                for (int j = 0; j < 8; j++) {
                    __m256i ws = _mm256_xor_si256(v[j], bias), xb = _mm256_set1_epi32(xv[j]);
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(
                        _mm256_maddubs_epi16(_mm256_sign_epi8(ws, ws), _mm256_sign_epi8(xb, ws)), one));
                }
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(x[i].d[b])), acc[i]);
#endif
            }
        }
        for (int i = 0; i < nx; i++) _mm256_storeu_ps(y + i * ldy + 8 * half, acc[i]);
    }
#else
    (void)pf;
    float acc[4][16];
    memset(acc, 0, sizeof(acc));
    for (int64_t b = 0; b < nb; b++, w += X8_BYTES)
        for (int r = 0; r < 16; r++) {
            float d = h2f(w + 2 * r);
            for (int i = 0; i < nx; i++) {
                const int8_t *q = x[i].q + 32 * b;
                int s = 0;
                for (int j = 0; j < 8; j++)
                    for (int k = 0; k < 4; k++) s += ((int)w[32 + 64 * j + 4 * r + k] - 128) * q[4 * j + k];
                acc[i][r] += d * x[i].d[b] * s;
            }
        }
    for (int i = 0; i < nx; i++) memcpy(y + i * ldy, acc[i], sizeof(acc[i]));
#endif
}

static void x16_q8_dequant_row(const uint8_t *seg, int64_t r, int64_t nb, float *out) {
    const uint8_t *w = seg + (r / 16) * nb * X8_BYTES;
    int l = (int)(r % 16);
    for (int64_t b = 0; b < nb; b++, w += X8_BYTES) {
        float d = h2f(w + 2 * l);
        for (int j = 0; j < 8; j++)
            for (int k = 0; k < 4; k++) out[32 * b + 4 * j + k] = ((int)w[32 + 64 * j + 4 * l + k] - 128) * d;
    }
}
