/* Products of several rows of x with Q4x16 / Q8x16 weights on Intel AMX tiles
 * (included by cpu_quant.c after cpu_q4x16.c and cpu_q8x16.c).
 *
 * Why: the AVX-512 group kernels spend 8 u8 x s8 dot instructions on every
 * 32-block of 16 weight rows for every row of x (the dot unit's throughput bounds
 * them from a few rows on), so a prompt costs its tokens' products one by one.
 * One AMX tile product (TDPBSUD) does the block for up to 16 rows of x at once:
 *   A: x's int8 block, [m rows, 32 bytes], read in place (row stride = cols);
 *   B: the block's weights, [8 rows, 64 bytes], row j holding for output row r
 *      the unsigned bytes 4j .. 4j+3 at 4 r: Q8x16's eight chunks as they lie
 *      in memory (stride 64), Q4x16's nibbles unpacked into a staging buffer
 *      (low nibbles of chunks 0..3 give rows 0..3, high nibbles rows 4..7);
 *   C: [m, 16] int32, row i = token i's sums for the 16 output rows,
 * then each token's row is scaled and added as the AVX-512 kernels do
 * (Q4x16: d dx C + m sx; Q8x16, codes stored as w + 128: d dx C - 128 d sx).
 * Two blocks are in flight (tiles 0-2 and 3-5) so the tile unit and the
 * vector FMAs overlap. Results equal the AVX-512 kernels' up to the order of
 * fp32 sums (the int32 block sums are exact in both).
 *
 * Built only where the compiler targets AMX-INT8 and AVX-512 (-march=native on
 * such a CPU); used only when Linux grants the process the tile data state
 * (arch_prctl ARCH_REQ_XCOMP_PERM) and `ss_set_amx` has not switched it off.
 */
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(SS_AVX512) && defined(__linux__)
#define SS_AMX 1
#include <sys/syscall.h>

#define AMX_MAX_M 16
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_config_t;

static _Atomic int amx_state = -1;     /* -1 not asked yet, 0 off, 1 on */
/* The rows of x this thread's tiles are configured for (-1: none). Other code on the
 * thread (a BLAS, oneDNN) may configure tiles its own way, so a configuration is kept
 * only within one chunk of a product: `amx_done` releases the tiles at its end. */
static __thread int amx_rows = -1;

static int amx_permitted(void) {
    int s = atomic_load(&amx_state);
    if (s < 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        atomic_store(&amx_state, s);
    }
    return s;
}

static void amx_configure(int m) {
    if (amx_rows == m) return;
    amx_config_t c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 6; t += 3) {
        c.rows[t] = (uint8_t)m;     c.colsb[t] = 64;       /* C: m x 16 int32 */
        c.rows[t + 1] = (uint8_t)m; c.colsb[t + 1] = 32;   /* A: m x 32 int8 */
        c.rows[t + 2] = 8;          c.colsb[t + 2] = 64;   /* B: 8 x 64 uint8 */
    }
    _tile_loadconfig(&c);
    amx_rows = m;
}

static void amx_done(void) {
    if (amx_rows >= 0) { _tile_release(); amx_rows = -1; }
}

/* Q4x16 blocks [b0, b1) of a group unpacked into B tiles (512 bytes each) at buf:
 * done a run of blocks ahead of the tile loads, since a tile load right behind the
 * vector stores that wrote its bytes stalls. */
static void amx_unpack(const uint8_t *w, int64_t b0, int64_t b1, uint8_t *buf) {
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t b = b0; b < b1; b++, buf += 512) {
        const uint8_t *p = w + b * X16_BYTES;
        for (int j = 0; j < 4; j++) {
            __m512i v = _mm512_loadu_si512(p + 64 + 64 * j);
            _mm512_store_si512(buf + 64 * j, _mm512_and_si512(v, low));
            _mm512_store_si512(buf + 256 + 64 * j, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
        }
    }
}

/* token rows of C (int32 [m, 16]) into the accumulators, block b */
static inline void amx_scale(int q8, const uint8_t *w, const int32_t *c, const float *xd, const float *xs,
                             int64_t nbx, int64_t b, int m, __m512 *acc) {
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
    __m512 off = q8 ? _mm512_mul_ps(d, _mm512_set1_ps(-128.0f))
                    : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 32)));
    for (int i = 0; i < m; i++) {
        __m512 s = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * i));
        acc[i] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(xd[i * nbx + b])), acc[i]);
        acc[i] = _mm512_fmadd_ps(off, _mm512_set1_ps(xs[i * nbx + b]), acc[i]);
    }
}

/* y[i * ldy + r] for the 16 rows of group w (nb blocks, Q4x16 or Q8x16) and the
 * m (1..16) rows of x starting at xq (int8, row stride cols), with their block
 * scales xd and scaled sums xs (row stride nbx = cols / 32). Software-pipelined:
 * block b's tile product is issued before block b - 1's sums are read back and
 * scaled (tiles 0-2 even blocks, 3-5 odd ones). Q4x16 blocks are unpacked
 * (`amx_unpack`) AMX_RUN at a time. */
#define AMX_RUN 32
#define AMX_ISSUE(TC, TA, TB, b) do {                                            \
        for (int64_t l_ = 0; l_ < bytes; l_ += 64)                               \
            _mm_prefetch((const char *)pf + (b) * bytes + l_, _MM_HINT_T0);      \
        _tile_loadd(TB, q8 ? w + (b) * bytes + 32 : unpacked + ((b) - r0) * 512, 64); \
        _tile_loadd(TA, xq + 32 * (b), cols);                                    \
        _tile_zero(TC);                                                          \
        _tile_dpbsud(TC, TA, TB);                                                \
    } while (0)
static void amx_group(int q8, const uint8_t *w, int64_t nb, const int8_t *xq, int64_t cols,
                      const float *xd, const float *xs, int m, float *y, int64_t ldy, const uint8_t *pf) {
    const int64_t bytes = q8 ? X8_BYTES : X16_BYTES, nbx = cols / 32;
    __m512 acc[AMX_MAX_M];
    int32_t c[2][16 * AMX_MAX_M] __attribute__((aligned(64)));
    uint8_t unpacked[AMX_RUN * 512] __attribute__((aligned(64)));
    for (int i = 0; i < m; i++) acc[i] = _mm512_setzero_ps();
    amx_configure(m);
    for (int64_t r0 = 0; r0 < nb; r0 += AMX_RUN) {
        int64_t r1 = r0 + AMX_RUN < nb ? r0 + AMX_RUN : nb;
        if (!q8) amx_unpack(w, r0, r1, unpacked);
        AMX_ISSUE(0, 1, 2, r0);
        int64_t b = r0 + 1;
        for (; b + 1 < r1; b += 2) {
            AMX_ISSUE(3, 4, 5, b);
            _tile_stored(0, c[0], 64);
            amx_scale(q8, w + (b - 1) * bytes, c[0], xd, xs, nbx, b - 1, m, acc);
            AMX_ISSUE(0, 1, 2, b + 1);
            _tile_stored(3, c[1], 64);
            amx_scale(q8, w + b * bytes, c[1], xd, xs, nbx, b, m, acc);
        }
        if (b < r1) {            /* one odd block left */
            AMX_ISSUE(3, 4, 5, b);
            _tile_stored(0, c[0], 64);
            amx_scale(q8, w + (b - 1) * bytes, c[0], xd, xs, nbx, b - 1, m, acc);
            _tile_stored(3, c[1], 64);
            amx_scale(q8, w + b * bytes, c[1], xd, xs, nbx, b, m, acc);
        } else {                 /* the last issued block is even */
            _tile_stored(0, c[0], 64);
            amx_scale(q8, w + (b - 1) * bytes, c[0], xd, xs, nbx, b - 1, m, acc);
        }
    }
    for (int i = 0; i < m; i++) _mm512_storeu_ps(y + i * ldy, acc[i]);
}
#endif

/* Whether the tile path takes products of m rows of x: from AMX_MIN_M rows. Each
 * tile product carries a fixed cost of about 60 cycles (loads, product, store of
 * small tiles), as much as the AVX-512 kernels spend on 7-8 rows of x, so below
 * that they stay; Q4x16 from 16 rows, as its nibbles are unpacked for the tile
 * first. Measured on a 2-core Xeon with AMX against them (benchmarks/cpu/bench_amx.py):
 * the Q8_0 LM head 1.4-1.5x at 12-32 rows; the default model's Q4_1 products, timed
 * alone, within +-6% of the AVX-512 kernels at 16-64 rows, yet its prompts prefill
 * 4-15% faster with the tiles (what the products alone miss was not found). */
#define AMX_MIN_M 8
#define AMX_MIN_M_Q4 16
static int amx_on = 1;     /* ss_set_amx */
static int amx_takes(int64_t m, int q8) {
#if defined(SS_AMX)
    return amx_on && m >= (q8 ? AMX_MIN_M : AMX_MIN_M_Q4) && amx_permitted();
#else
    (void)m; (void)q8;
    return 0;
#endif
}

/* enable: 1 on, 0 off, -1 ask. Returns whether products of several rows of x
 * run on AMX tiles from now on (0 where the build or the OS has none). */
int ss_set_amx(int enable) {
    if (enable >= 0) amx_on = enable != 0;
    return amx_takes(16, 1);
}
