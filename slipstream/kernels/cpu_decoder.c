/* A whole decode step of a Llama-family model in one call (included by
 * cpu_quant.c, so it shares its kernels and thread pool).
 *
 * Every sequence brings one token (ss_decode_step), or a few tokens with a mask
 * among them (ss_tree_step: draft verification, the products then M-row GEMMs
 * that read each weight block once). For each layer:
 *   h = rmsnorm(r) * w1;  qkv = h @ Wqkv^T (+ b);  rotary on the q and k heads;
 *   k, v -> the paged cache at the token's slot;  o = attention over the cache;
 *   r += o @ Wo^T (+ b);  h = rmsnorm(r) * w2;  gu = h @ Wgu^T;
 *   r += (silu(g) * u) @ Wd^T
 * and at the end x = rmsnorm(r) * wf. The residual stream r starts as the
 * embeddings in x. All fp32; the products are `ss_matmul`'s (int8 activations
 * for the 32-block formats), so the result is that of the layer-by-layer path
 * up to the order of fp32 sums. Twin: the model's own forward (torch ops and
 * the same kernels one by one).
 */

typedef struct {                 /* one product: W given as 1..MAX_SEG segments */
    int32_t n_seg; int32_t type[MAX_SEG]; const uint8_t *w[MAX_SEG]; int64_t rows[MAX_SEG];
    const float *bias;           /* [rows] or NULL */
} ss_linear_t;

typedef struct {
    ss_linear_t qkv, o, gate_up, down;
    const float *norm1, *norm2;  /* [hidden] */
    void *k_cache, *v_cache;     /* [num_blocks, block_size, nkv, hd], fp32 or bf16 */
    const ss_kivi_t *kivi;       /* NULL, or a KIVI cache (k/v_cache its window pool) */
} ss_layer_t;

typedef struct {
    int32_t n_layers, hidden, nh, nkv, hd, inter, block_size, kv_bf16;
    float eps, scale; int64_t window;      /* window 0: none */
    const float *cos, *sin;                /* [max_position, hd]: [cos|cos], [-sin|sin] */
    const float *final_norm;               /* [hidden] */
    const ss_layer_t *layers;
    int32_t n_taps;                        /* feature taps: after layer taps[i] (ascending), */
    const int32_t *taps;                   /* the residual stream goes to tap_out */
    float *tap_out;                        /* [b, n_taps * hidden], set per call */
    int64_t num_blocks, max_position;      /* the caches' blocks, the rotary tables' rows */
} ss_model_t;

static int64_t lin_rows(const ss_linear_t *l) {
    int64_t rows = 0;
    for (int s = 0; s < l->n_seg; s++) rows += l->rows[s];
    return rows;
}

static int lin(const ss_linear_t *l, int64_t cols, const float *x, int64_t m, float *y) {
    int64_t rows = lin_rows(l);
    int rc = ss_matmul(l->n_seg, l->type, l->w, l->rows, cols, x, m, y, rows);
    if (rc == 0 && l->bias)
        for (int64_t i = 0; i < m; i++) for (int64_t r = 0; r < rows; r++) y[i * rows + r] += l->bias[r];
    return rc;
}

static void rmsnorm(const float *x, const float *w, int64_t n, float eps, float *out) {
    float ss = 0;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

/* x [heads, hd] rotated in place: x * cos + [x2 | x1] * sin (sin signed) */
static void rotary(float *x, int heads, int hd, const float *cos, const float *sin) {
    int half = hd / 2;
    for (int h = 0; h < heads; h++, x += hd)
        for (int i = 0; i < half; i++) {
            float a = x[i], b = x[i + half];
            x[i] = a * cos[i] + b * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
}

/* The layer after its attention, for b rows: r += att @ Wo^T; then
 * r += (silu(g) * u) @ Wd^T with [g ; u] = (rmsnorm(r) * norm2) @ Wgu^T.
 * h [b, H], gu [b, 2 I], act [b, I]: scratch. */
static int attn_out_mlp(const ss_linear_t *o, const ss_linear_t *gate_up, const ss_linear_t *down,
                        const float *norm2, float eps, int64_t b, int64_t H, int64_t nq, int64_t I,
                        const float *att, float *r, float *h, float *gu, float *act) {
    int rc;
    if ((rc = lin(o, nq, att, b, h))) return rc;
    for (int64_t i = 0; i < b * H; i++) r[i] += h[i];
    for (int64_t i = 0; i < b; i++) rmsnorm(r + i * H, norm2, H, eps, h + i * H);
    if ((rc = lin(gate_up, H, h, b, gu))) return rc;
    for (int64_t i = 0; i < b; i++) silu_mul(gu + i * 2 * I, gu + i * 2 * I + I, I, act + i * I);
    if ((rc = lin(down, I, act, b, h))) return rc;
    for (int64_t i = 0; i < b * H; i++) r[i] += h[i];
    return 0;
}

/* Where a step's tokens attend: one token per sequence (qloc NULL: the decode
 * attention) or a few (ss_tree_attention, qloc/masks/max_q as there). */
typedef struct {
    const int32_t *tables; int64_t table_stride; const int32_t *seq_lens; const int64_t *slots;
    const int32_t *qloc; const uint64_t *masks; int64_t n_seqs; int max_q;
} ss_attend_t;

/* The step's indices against the caches, tables and rotary rows, before any is
 * used: a bad one would read or write outside them. 0, or the first check that
 * fails: -2 a position, -3 a slot, -4 a sequence's lengths (or its table row's
 * width), -5 a block id in the rows its attention reads (not checked over a
 * KIVI cache, whose tables index its sealed blocks). */
static int check_step(const ss_model_t *m, int64_t b, const int64_t *positions, const ss_attend_t *at) {
    int64_t bs = m->block_size, cap = m->num_blocks * bs;
    for (int64_t i = 0; i < b; i++) {
        if (positions[i] < 0 || positions[i] >= m->max_position) return -2;
        if (at->slots[i] < -1 || at->slots[i] >= cap) return -3;
    }
    if (at->qloc && (at->qloc[0] != 0 || at->qloc[at->n_seqs] != b)) return -4;
    if (!at->qloc && at->n_seqs != b) return -4;
    for (int64_t s = 0; s < at->n_seqs; s++) {
        int64_t n = at->seq_lens[s], q = at->qloc ? at->qloc[s + 1] - at->qloc[s] : 1;
        if (q < 1 || q > at->max_q || n < q || n > at->table_stride * bs) return -4;
        if (m->layers[0].kivi) continue;
        int64_t lo = m->window > 0 && n - q + 1 > m->window ? n - q + 1 - m->window : 0;
        const int32_t *row = at->tables + s * at->table_stride;
        for (int64_t j = lo / bs; j <= (n - 1) / bs; j++)
            if (row[j] < 0 || row[j] >= m->num_blocks) return -5;
    }
    return 0;
}

/* x: [b, hidden] embeddings of the step's b tokens in, final normed hidden
 * states out. Returns 0, -1 on shapes the kernels reject, or check_step's code. */
static int run_step(const ss_model_t *m, float *x, int64_t b, const int64_t *positions, const ss_attend_t *at) {
    int64_t H = m->hidden, hd = m->hd, nq = (int64_t)m->nh * hd, nkvd = (int64_t)m->nkv * hd;
    int64_t wqkv = nq + 2 * nkvd, I = m->inter;
    if (hd > 512 || m->nkv < 1 || m->nh % m->nkv || hd % 2) return -1;
    int bad = check_step(m, b, positions, at);
    if (bad) return bad;
    int64_t need = b * (H + H + wqkv + nq + 2 * I + I);
    float *buf = malloc(need * sizeof(float));
    if (!buf) return -1;
    float *r = buf, *h = r + b * H, *qkv = h + b * H, *att = qkv + b * wqkv, *gu = att + b * nq, *act = gu + b * 2 * I;
    memcpy(r, x, b * H * sizeof(float));
    int rc = 0;
    for (int l = 0; l < m->n_layers && rc == 0; l++) {
        const ss_layer_t *L = &m->layers[l];
        for (int64_t i = 0; i < b; i++) rmsnorm(r + i * H, L->norm1, H, m->eps, h + i * H);
        if ((rc = lin(&L->qkv, H, h, b, qkv))) break;
        for (int64_t i = 0; i < b; i++) {
            const float *c = m->cos + positions[i] * hd, *s = m->sin + positions[i] * hd;
            rotary(qkv + i * wqkv, m->nh + m->nkv, (int)hd, c, s);
        }
        if (at->qloc && L->kivi) rc = -1;   /* KIVI: decode steps only */
        else if (at->qloc)
            rc = ss_tree_attention(qkv, wqkv, L->k_cache, L->v_cache, m->kv_bf16, at->tables, at->table_stride,
                                   at->seq_lens, at->qloc, at->masks, at->n_seqs, at->max_q, m->nh, m->nkv,
                                   (int)hd, m->block_size, m->scale, m->window,
                                   qkv + nq, wqkv, qkv + nq + nkvd, wqkv, at->slots, att);
        else
            rc = ss_decode_attention(qkv, wqkv, L->k_cache, L->v_cache, m->kv_bf16, at->tables, at->table_stride,
                                     at->seq_lens, b, m->nh, m->nkv, (int)hd, m->block_size, m->scale, m->window,
                                     qkv + nq, wqkv, qkv + nq + nkvd, wqkv, at->slots, att, L->kivi);
        if (rc || (rc = attn_out_mlp(&L->o, &L->gate_up, &L->down, L->norm2, m->eps, b, H, nq, I,
                                     att, r, h, gu, act))) break;
        for (int t = 0; t < m->n_taps; t++)
            if (m->taps[t] == l)
                for (int64_t i = 0; i < b; i++)
                    memcpy(m->tap_out + (i * m->n_taps + t) * H, r + i * H, H * sizeof(float));
    }
    if (rc == 0)
        for (int64_t i = 0; i < b; i++) rmsnorm(r + i * H, m->final_norm, H, m->eps, x + i * H);
    free(buf);
    return rc;
}

/* Every sequence brings one token: x [b, hidden]. */
int ss_decode_step(const ss_model_t *m, float *x, int64_t b, const int64_t *positions,
                   const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                   const int64_t *slots) {
    ss_attend_t at = { tables, table_stride, seq_lens, slots, NULL, NULL, b, 1 };
    return run_step(m, x, b, positions, &at);
}

/* n_seqs sequences bring qloc[s + 1] - qloc[s] tokens each (at most max_q <= 64),
 * x [qloc[n_seqs], hidden]; token t sees the step's tokens masks[t] marks (see
 * ss_tree_attention). Each weight block is read once for all the tokens. */
int ss_tree_step(const ss_model_t *m, float *x, const int64_t *positions, const int32_t *tables,
                 int64_t table_stride, const int32_t *seq_lens, const int64_t *slots, int64_t n_seqs,
                 const int32_t *qloc, const uint64_t *masks, int max_q) {
    ss_attend_t at = { tables, table_stride, seq_lens, slots, qloc, masks, n_seqs, max_q };
    return run_step(m, x, qloc[n_seqs], positions, &at);
}
