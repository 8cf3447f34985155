/* EAGLE's draft head on the CPU in one call (included by cpu_quant.c after
 * cpu_decoder.c, whose products, norms, rotary and layer tail it shares).
 *
 * The head is one decoder layer over fc([embed(token) ; feature]):
 *   x = fc([e ; f]);  a = rmsnorm(x) * w_attn;  qkv = a @ Wqkv^T;  rotary on q, k;
 *   o = attention over the head's context (the past rows `valid` marks, then the
 *       rows of this call and the calls before it in the same chain, causally);
 *   x += o @ Wo^T;  x += down(silu(g) * u) with [g ; u] = (rmsnorm(x) * w_mlp) @ Wgu^T;
 *   feature out = rmsnorm(x) * w_out.
 * ss_eagle_pass runs T rows of it (the head catching up on the target's states);
 * ss_eagle_chain drafts: from the root's feature, `depth` levels, each the top-k
 * of log_softmax(draft LM head (feature)), the best of them fed back with its
 * feature (a chain with k - 1 siblings a level), or one token a level drawn from
 * the softmax at a temperature (drafts for sampled requests). Twin: spec/eagle_head.py's
 * forward and spec/eagle_tree.py's expansion with beam 1.
 */

typedef struct {
    int32_t hidden, nh, nkv, hd, inter;
    float eps, scale;
    int64_t max_position;
    const float *cos, *sin;                    /* [max_position, hd]: [cos|cos], [-sin|sin] */
    ss_linear_t fc, qkv, o, gate_up, down;     /* fc: 2 hidden -> hidden */
    ss_linear_t lm;                            /* the draft LM head: feature -> V' logits */
    const int32_t *token_of_col;               /* [V'] draft column -> token id, or NULL */
    const float *attn_norm, *mlp_norm, *out_norm;
    int32_t emb_type; const uint8_t *emb;      /* the target's embedding (ss_get_rows) */
} ss_eagle_t;

/* Query q [hd] of KV head g against the past rows (valid) and `n_new` new rows
 * (all visible): softmax(q k^T * scale) v into out [hd]. The attention kernels'
 * pieces: scores 16 keys at a time, the max and sum as vectors, V rows added
 * in registers, not a dependent chain of additions a key and a libm exp. */
static void head_attend(const ss_eagle_t *e, const float *q, int g, const float *pk, const float *pv,
                        const uint8_t *valid, int64_t ctx, const float *nk, const float *nv,
                        int64_t n_new, float *scores, float *out) {
    int64_t hd = e->hd, row = (int64_t)e->nkv * hd, n = ctx + n_new;
    const float *rows[64];
    for (int64_t j0 = 0; j0 < n; j0 += 64) {
        int nt = n - j0 < 64 ? (int)(n - j0) : 64;
        for (int j = 0; j < nt; j++) {
            int64_t t = j0 + j;
            rows[j] = (t < ctx ? pk + t * row : nk + (t - ctx) * row) + g * hd;
        }
        dots_keys(q, rows, nt, hd, e->scale, scores + j0);
        for (int j = 0; j < nt; j++)
            if (j0 + j < ctx && !valid[j0 + j]) scores[j0 + j] = -INFINITY;
    }
    for (int64_t i = 0; i < hd; i++) out[i] = 0;
    float mx = tile_max(scores, (int)n);
    if (mx == -INFINITY) return;
    for (int64_t j = 0; j < n; j++) scores[j] -= mx;     /* (-inf stays -inf: weight 0) */
    exp_tile(scores, (int)n);
    float sum = tile_sum(scores, (int)n);
    for (int64_t j0 = 0; j0 < n; j0 += 64) {
        int nt = n - j0 < 64 ? (int)(n - j0) : 64;
        for (int j = 0; j < nt; j++) {
            int64_t t = j0 + j;
            rows[j] = (t < ctx ? pv + t * row : nv + (t - ctx) * row) + g * hd;
        }
        pv_tile(scores + j0, rows, nt, hd, out);
    }
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < hd; i++) out[i] *= inv;
}

/* t rows: emb, feat [t, hidden] -> f_out [t, hidden]. The rows' K and V go to
 * nk, nv [first .. first + t) ([rows, nkv, hd]); row i sees the past rows valid
 * marks and the new rows 0 .. first + i. */
static int head_rows(const ss_eagle_t *e, const float *emb, const float *feat, int64_t t,
                     const int64_t *positions, const float *pk, const float *pv, const uint8_t *valid,
                     int64_t ctx, float *nk, float *nv, int64_t first, float *f_out) {
    int64_t H = e->hidden, hd = e->hd, nq = (int64_t)e->nh * hd, nkvd = (int64_t)e->nkv * hd;
    int64_t wqkv = nq + 2 * nkvd, I = e->inter;
    if (hd % 2 || e->nkv < 1 || e->nh % e->nkv || lin_rows(&e->qkv) != wqkv || lin_rows(&e->fc) != H
        || lin_rows(&e->gate_up) != 2 * I || lin_rows(&e->down) != H || lin_rows(&e->o) != H)
        return -1;
    for (int64_t i = 0; i < t; i++)
        if (positions[i] < 0 || positions[i] >= e->max_position) return -1;
    int64_t need = t * (2 * H + H + H + wqkv + nq + 2 * I + I) + ctx + first + t;
    float *buf = malloc(need * sizeof(float));
    if (!buf) return -1;
    float *cat = buf, *x = cat + t * 2 * H, *h = x + t * H, *qkv = h + t * H, *att = qkv + t * wqkv;
    float *gu = att + t * nq, *act = gu + t * 2 * I, *scores = act + t * I;
    int rc = 0;
    for (int64_t i = 0; i < t; i++) {
        memcpy(cat + i * 2 * H, emb + i * H, H * sizeof(float));
        memcpy(cat + i * 2 * H + H, feat + i * H, H * sizeof(float));
    }
    if ((rc = lin(&e->fc, 2 * H, cat, t, x))) goto done;
    for (int64_t i = 0; i < t; i++) rmsnorm(x + i * H, e->attn_norm, H, e->eps, h + i * H);
    if ((rc = lin(&e->qkv, H, h, t, qkv))) goto done;
    for (int64_t i = 0; i < t; i++) {
        float *r = qkv + i * wqkv;
        rotary(r, e->nh + e->nkv, (int)hd, e->cos + positions[i] * hd, e->sin + positions[i] * hd);
        memcpy(nk + (first + i) * nkvd, r + nq, nkvd * sizeof(float));
        memcpy(nv + (first + i) * nkvd, r + nq + nkvd, nkvd * sizeof(float));
    }
    int group = e->nh / e->nkv;
    for (int64_t i = 0; i < t; i++)
        for (int hh = 0; hh < e->nh; hh++)
            head_attend(e, qkv + i * wqkv + hh * hd, hh / group, pk, pv, valid, ctx, nk, nv,
                        first + i + 1, scores, att + i * nq + hh * hd);
    if ((rc = attn_out_mlp(&e->o, &e->gate_up, &e->down, e->mlp_norm, e->eps, t, H, nq, I, att,
                           x, h, gu, act))) goto done;
    for (int64_t i = 0; i < t; i++) rmsnorm(x + i * H, e->out_norm, H, e->eps, f_out + i * H);
done:
    free(buf);
    return rc;
}

/* The head over t rows of the target's states (catching up): K, V of the rows out. */
int ss_eagle_pass(const ss_eagle_t *e, const float *emb, const float *feat, int64_t t,
                  const int64_t *positions, const float *pk, const float *pv, const uint8_t *valid,
                  int64_t ctx, float *k_out, float *v_out, float *f_out) {
    if (t < 1) return -1;
    return head_rows(e, emb, feat, t, positions, pk, pv, valid, ctx, k_out, v_out, 0, f_out);
}

/* The top k of log_softmax(logits [n]) -> cols, logp (best first; ties: lower column).
 * The softmax's sum runs over 16 lanes with the vectorized exp (a double-precision
 * libm call a column cost about as much as the level's LM-head product). */
static void top_logp(const float *logits, int64_t n, int k, int32_t *cols, float *logp) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) mx = logits[j] > mx ? logits[j] : mx;
    float lane[16] = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int i = 0; i < 16; i++) lane[i] += exp_any(logits[j + i] - mx);
    double sum = 0;
    for (int i = 0; i < 16; i++) sum += lane[i];
    for (; j < n; j++) sum += exp_any(logits[j] - mx);
    float lse = mx + (float)log(sum);
    for (int i = 0; i < k; i++) { cols[i] = -1; logp[i] = -INFINITY; }
    for (j = 0; j < n; j++) {
        float v = logits[j];
        if (cols[k - 1] >= 0 && v <= logp[k - 1]) continue;
        int i = k - 1;
        while (i > 0 && (cols[i - 1] < 0 || v > logp[i - 1])) { cols[i] = cols[i - 1]; logp[i] = logp[i - 1]; i--; }
        cols[i] = (int32_t)j; logp[i] = v;
    }
    for (int i = 0; i < k; i++) logp[i] -= lse;
}

/* From the root's feature [hidden]: level l (0 .. depth - 1) holds the top k
 * tokens after the best token of level l - 1 (level 0: after the root), tokens
 * and their log-probabilities [depth, k] out. The past is the head's context
 * (ctx rows, `valid` marks the real ones); the draft's own rows sit at
 * positions base, base + 1, ... The chain stops at the first level whose best
 * token's cumulative log-probability falls below min_logp (-inf: never).
 * temperature > 0 (k = 1): each level's token is drawn instead, from
 * q = softmax(logits / temperature) by the inverse of its cumulative sum at
 * uniforms[l]; q [depth, V'] (over the draft columns) and log q(token) out.
 * Returns the levels kept (0 .. depth; those before the stop), -1 on bad arguments. */
static int64_t sample_col(const float *logits, int64_t n, float temperature, float u, float *q,
                          float *logq) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) mx = logits[j] > mx ? logits[j] : mx;
    const float inv = 1.0f / temperature;
    double sum = 0;
    for (int64_t j = 0; j < n; j++) { q[j] = exp_any((logits[j] - mx) * inv); sum += q[j]; }
    const float norm = (float)(1.0 / sum);
    double target = (double)u * sum, run = 0;
    int64_t col = -1;
    for (int64_t j = 0; j < n; j++) {
        if (col < 0 && q[j] > 0) { run += q[j]; if (run > target) col = j; }
        q[j] *= norm;
    }
    if (col < 0) { col = n - 1; while (col > 0 && q[col] == 0) col--; }   /* rounding at the top */
    *logq = logf(q[col]);
    return col;
}

int ss_eagle_chain(const ss_eagle_t *e, const float *root_feat, const float *pk, const float *pv,
                   const uint8_t *valid, int64_t ctx, int64_t base, int depth, int k,
                   float min_logp, float temperature, const float *uniforms, float *q,
                   int64_t *tokens, float *logp) {
    int64_t H = e->hidden, nkvd = (int64_t)e->nkv * e->hd, V = lin_rows(&e->lm);
    if (depth < 1 || k < 1 || k > V) return -1;
    if (temperature > 0 && (k != 1 || !uniforms || !q)) return -1;
    float *buf = malloc(((int64_t)3 * H + V + 2 * depth * nkvd) * sizeof(float));
    int32_t *cols = malloc(k * sizeof(int32_t));
    if (!buf || !cols) { free(buf); free(cols); return -1; }
    float *feat = buf, *emb = feat + H, *f = emb + H, *logits = f + H, *nk = logits + V, *nv = nk + depth * nkvd;
    memcpy(feat, root_feat, H * sizeof(float));
    int rc = 0, kept = depth;
    float cum = 0;
    for (int l = 0; l < depth && rc == 0; l++) {
        if (l > 0) {           /* the head over the best token of the level before */
            int64_t tok = tokens[(l - 1) * k], pos = base + l - 1;
            if ((rc = ss_get_rows(e->emb_type, e->emb, H, &tok, 1, emb))) break;
            if ((rc = head_rows(e, emb, feat, 1, &pos, pk, pv, valid, ctx, nk, nv, l - 1, f))) break;
            memcpy(feat, f, H * sizeof(float));
        }
        if ((rc = lin(&e->lm, H, feat, 1, logits))) break;
        if (temperature > 0)
            cols[0] = (int32_t)sample_col(logits, V, temperature, uniforms[l], q + l * V, logp + l);
        else
            top_logp(logits, V, k, cols, logp + l * k);
        for (int i = 0; i < k; i++)
            tokens[l * k + i] = e->token_of_col ? e->token_of_col[cols[i]] : cols[i];
        cum += logp[l * k];
        if (cum < min_logp) { kept = l; break; }
    }
    free(buf); free(cols);
    return rc ? -1 : kept;
}
