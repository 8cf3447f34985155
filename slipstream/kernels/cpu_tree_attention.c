/* Attention for steps that bring a few tokens per sequence (draft verification:
 * a chain or a tree of drafts after the sequence's last token), over the paged
 * cache (included by cpu_quant.c after the decode attention it extends).
 *
 * Sequence s brings tokens qloc[s] .. qloc[s + 1] - 1 (q_s <= 64 of them) after
 * ctx = seq_lens[s] - q_s cached ones; its token i sits at cache position
 * ctx + i. Token t sees every cached key and the step's key ctx + j when bit j
 * of masks[t] is set (its tree ancestors and itself; for a chain every j <= i),
 * and with a window only keys p with (ctx + i) - p < window, as
 * reference.attention_mask does. The step's K/V are first stored at slots[t].
 *
 * A chunk is (sequence, KV head, a tile of the sequence's tokens) with every
 * query head of the GQA group: each K/V row is read once for all of the
 * chunk's queries (tokens x heads). Twin: reference.paged_attention with the
 * tree mask.
 */
#define QA_QUERIES 32            /* queries (tokens x heads of a group) a chunk holds */
typedef struct {
    const float *q; int64_t q_stride; const void *kc, *vc; int kv_bf16;
    const int32_t *tables; int64_t table_stride; const int32_t *seq_lens, *qloc; const uint64_t *masks;
    int nh, nkv, hd, bs; float scale; int64_t window; float *out; int tpc, tiles;
} qattn_args;

/* One query's online-softmax update over a tile of cnt keys: scores sc
 * (clobbered), V rows vr; the decode attention's arithmetic, in its order. */
static void qa_tile(float *sc, const float *const *vr, int cnt, int hd, float *mx, float *den, float *acc) {
    float m = tile_max(sc, cnt);
    m = m > *mx ? m : *mx;
    if (m == -INFINITY) return;           /* nothing seen yet: the tile adds nothing */
    if (m > *mx) {
        float f = expf(*mx - m);          /* 0 on the first tile seen */
        *den *= f;
        for (int e = 0; e < hd; e++) acc[e] *= f;
        *mx = m;
    }
    for (int j = 0; j < cnt; j++) sc[j] -= m;
    exp_tile(sc, cnt);
    *den += tile_sum(sc, cnt);
    pv_tile(sc, vr, cnt, hd, acc);       /* masked keys (and underflowed ones) add nothing */
}

/* Tiles of 64 keys from lo, shared by the chunk's queries, up to the tile that
 * holds the first of the step's keys; from there each query takes the keys it
 * sees, in order, in tiles of 64 of them: the tiles a chain of one-token steps
 * along the query's ancestors would take, so a tree node's row is the bits of
 * that chain's (without a window). */
#define QA_TAIL (2 * ATT_TILE)
static void qattn_chunk(void *a_, int64_t c) {
    qattn_args *a = a_;
    int G = a->nh / a->nkv, hd = a->hd;
    int64_t s = c / ((int64_t)a->nkv * a->tiles);
    int kvh = (int)(c / a->tiles % a->nkv), tile = (int)(c % a->tiles);
    int64_t q0 = a->qloc[s], qn = a->qloc[s + 1] - q0;
    int i0 = tile * a->tpc, i1 = i0 + a->tpc < qn ? i0 + a->tpc : (int)qn;
    if (i0 >= i1) return;
    int64_t n = a->seq_lens[s], ctx = n - qn, lo = n;
    const int32_t *table = a->tables + s * a->table_stride;
    int nq = (i1 - i0) * G;
    const float *q[QA_QUERIES];
    int64_t qpos[QA_QUERIES]; uint64_t qmask[QA_QUERIES];
    /* sized by the head dim (stack: ~90 KB at hd 64 with a bf16 cache's converted K and V rows) */
    float acc[QA_QUERIES][hd], sc[QA_QUERIES][QA_TAIL], mx[QA_QUERIES], den[QA_QUERIES];
    float kbuf[a->kv_bf16 ? QA_TAIL * hd : 1], vbuf[a->kv_bf16 ? QA_TAIL * hd : 1];
    const float *krow[QA_TAIL], *vrow[QA_TAIL];
    for (int k = 0; k < nq; k++) {
        int i = i0 + k / G, h = kvh * G + k % G;
        q[k] = a->q + (q0 + i) * a->q_stride + (int64_t)h * hd;
        qpos[k] = ctx + i; qmask[k] = a->masks[q0 + i];
        int64_t first = a->window > 0 && qpos[k] + 1 > a->window ? qpos[k] + 1 - a->window : 0;
        lo = first < lo ? first : lo;
        mx[k] = -INFINITY; den[k] = 0;
        for (int e = 0; e < hd; e++) acc[k][e] = 0;
    }
    int64_t tail = ctx > lo ? lo + (ctx - lo) / ATT_TILE * ATT_TILE : lo;
    for (int64_t t0 = lo; t0 < n; t0 += ATT_TILE) {
        int nt = t0 < tail ? ATT_TILE : (int)(n - t0);     /* the last: the tail, to n */
        int64_t tb = t0 / a->bs, tt = t0 % a->bs;
        for (int j = 0; j < nt; j++) {   /* K and V rows (bf16 ones converted once) */
            int64_t off = (((int64_t)table[tb] * a->bs + tt) * a->nkv + kvh) * hd;
            if (++tt == a->bs) { tt = 0; tb++; }
            krow[j] = (const float *)a->kc + off;
            vrow[j] = (const float *)a->vc + off;
            if (a->kv_bf16) {
                load_row(a->kc, 1, off, hd, kbuf + j * hd); krow[j] = kbuf + j * hd;
                load_row(a->vc, 1, off, hd, vbuf + j * hd); vrow[j] = vbuf + j * hd;
            }
        }
        for (int k = 0; k < nq; k++) {   /* every query's scores, then the keys it does not see masked */
            dots_keys(q[k], krow, nt, hd, a->scale, sc[k]);
            for (int j = 0; j < nt; j++) {
                int64_t t = t0 + j;
                int seen = t < ctx || ((qmask[k] >> (t - ctx)) & 1);
                if (a->window > 0 && qpos[k] - t >= a->window) seen = 0;
                if (!seen) sc[k][j] = -INFINITY;
            }
        }
        if (t0 < tail) {
            for (int k = 0; k < nq; k++) qa_tile(sc[k], vrow, nt, hd, &mx[k], &den[k], acc[k]);
            continue;
        }
        for (int k = 0; k < nq; k++) {        /* the tail: the keys each query sees, 64 at a time */
            float ts[ATT_TILE]; const float *tv[ATT_TILE];
            int cnt = 0;
            for (int j = 0; j < nt; j++) {
                if (sc[k][j] == -INFINITY) continue;
                ts[cnt] = sc[k][j]; tv[cnt++] = vrow[j];
                if (cnt == ATT_TILE) { qa_tile(ts, tv, cnt, hd, &mx[k], &den[k], acc[k]); cnt = 0; }
            }
            if (cnt) qa_tile(ts, tv, cnt, hd, &mx[k], &den[k], acc[k]);
        }
        break;
    }
    for (int k = 0; k < nq; k++) {
        int i = i0 + k / G, h = kvh * G + k % G;
        float *o = a->out + ((q0 + i) * a->nh + h) * hd;   /* as the decode attention divides */
        for (int e = 0; e < hd; e++) o[e] = den[k] > 0 ? acc[k][e] / den[k] : 0;
    }
}

/* q: token t's heads start at q + t * q_stride; k_new/v_new likewise (kv heads
 * contiguous), stored at slots[t] (-1: skipped) before attending; out
 * [num_tokens, nh, hd]. max_q: the most tokens a sequence brings (<= 64).
 * Returns 0, or -1 on shapes it does not take. */
int ss_tree_attention(const float *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                      int kv_bf16, const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                      const int32_t *qloc, const uint64_t *masks, int64_t num_seqs, int max_q,
                      int nh, int nkv, int hd, int bs, float scale, int64_t window,
                      const float *k_new, int64_t k_stride, const float *v_new, int64_t v_stride,
                      const int64_t *slots, float *out) {
    if (hd > 512 || nkv < 1 || nh % nkv || nh / nkv > QA_QUERIES || max_q < 1 || max_q > 64) return -1;
    int64_t num_tokens = qloc[num_seqs];
    if (k_new)
        for (int64_t t = 0; t < num_tokens; t++) {
            if (slots[t] < 0) continue;
            store_row((void *)k_cache, kv_bf16, slots[t] * nkv * hd, k_new + t * k_stride, (int64_t)nkv * hd);
            store_row((void *)v_cache, kv_bf16, slots[t] * nkv * hd, v_new + t * v_stride, (int64_t)nkv * hd);
        }
    /* tokens per chunk: as many as the query budget holds, fewer while that
     * leaves fewer than 4 chunks a thread */
    int G = nh / nkv, tpc = QA_QUERIES / G;
    if (tpc > max_q) tpc = max_q;
    while (tpc > 1 && num_seqs * nkv * ((max_q + tpc - 1) / tpc) < 4 * (P.n_workers + 1)) tpc = (tpc + 1) / 2;
    int tiles = (max_q + tpc - 1) / tpc;
    qattn_args a = { q, q_stride, k_cache, v_cache, kv_bf16, tables, table_stride, seq_lens, qloc, masks,
                     nh, nkv, hd, bs, scale, window, out, tpc, tiles };
    parallel_for(qattn_chunk, &a, num_seqs * nkv * tiles);
    return 0;
}
