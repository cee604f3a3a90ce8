/* Decode attention that reads the paged KV pool in place (CPU).
 *
 * Each sequence attends `rows` query rows per KV head (the g query heads of a decode that share
 * a KV head, or a cascade group's stacked queries) over its context, read page by page through
 * its page table: no gathered copy of the context, no padding to the longest sequence. A work
 * item is one chunk of one sequence with all its heads, so each token's K and V rows are read as
 * one contiguous run. Contexts longer than `chunk` tokens are split into chunks that run in
 * parallel (split-K, as in flash-decoding) and merged through their log-sum-exps, so a few long
 * sequences still use every thread. Math in fp32; K/V/q/out in bf16 or fp32.
 *
 * Built at first use by runtime/attention/cpu_kernel.py (gcc -O3 -march=native -fopenmp) and
 * called through ctypes, which releases the GIL. Three paths, fastest first:
 * - bf16 on a CPU with AVX512-BF16 and a head size that is a multiple of 32
 *   (attend_chunk_bf16): tiles of 16 tokens, one per lane; K is transposed in registers so a
 *   row's 16 scores are bf16 pair dot products (vdpbf16ps) with no horizontal sums, P·V is
 *   vdpbf16ps over token pairs, and every long dependency chain is split in four (~1.5× the
 *   AVX-512 path on a 2-core EPYC); query rows go three at a time (two where four are left), so
 *   each K and V load serves them all and their dependency chains interleave (pairs: 1.3-1.4×
 *   single rows on cascade groups and prefill; threes: prefill attention in 0.82-0.92× the time
 *   of pairs on a Zen 5, decode rows of SmolLM2's groups of 3 in cache 0.97×); the softmax's
 *   rescale factor skips its exp while a row's max holds (0.86× in cache); each row's sums run
 *   in the same order however rows are grouped; and each head's K and V are asked for two tiles
 *   ahead (prefetch_kv: ~1.85× on decode steps whose contexts do not fit in cache; from DRAM
 *   neither change above moves decode's time);
 * - AVX-512 and a head size that is a multiple of 16: explicit 16-lane scores and V sums;
 * - otherwise (attend_chunk_rows) a block's K and V copied in the pool's order, then eight
 *   tokens' scores at a time (AVX2) and the prefill path's V sum in registers: on a Zen 3,
 *   0.70x the time of the scalar-scored path it replaced with the context in cache, ~0.8x on
 *   decode steps that read it from DRAM (bench/cpu_decode_attention.py). There both take
 *   over 1.5x a plain read of the same pages (~30 GB/s): reads and math overlap little, and
 *   software prefetches (L1 or L2, of the next block or of the block's V before its scores)
 *   gained nothing measurable;
 * - the plain loops, vectorised by the compiler, for head sizes that are not a multiple of 8.
 *
 * paged_prefill attends prefill chunks causally: a work item is a block of a chunk's query
 * tokens on one KV head, whose rows share every K/V tile; each row stops at its own position, and
 * tiles past a block's last token are never read (the masked SDPA computes the masked half too).
 * bf16 on a CPU with AMX runs the tiles on AMX (attend_head_amx: a block's scores and P·V as
 * tile products, 0.48-0.52x the time of the AVX512-BF16 tiles on a 2-core Xeon), with
 * AVX512-BF16 the tile code above; anything else (fp32, or bf16 elsewhere) runs
 * attend_head_generic: K of a 32-token block transposed once into [hd][32] and shared by the
 * block's rows, so scores and V sums are plain loops the compiler turns into FMAs of the CPU's
 * own width (AVX2 on a Zen 3: ~3x torch's masked SDPA on 512-token chunks, fp32).
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#endif
#include <stdlib.h>
#include <string.h>

#include "cpu_common.h"

#define BLOCK 32 /* tokens converted to fp32 and scored at once */

/* exp(x) for x <= 0, f in [0, 1): enough for a softmax. */
static inline float exp_nonpos(float x) {
    float t = (x < -87.f ? -87.f : x) * 1.44269504f;
    float n = floorf(t);
    return exp2_split(n, t - n);
}

static void load_row(const void *src, size_t off, int bf16, int n, float *dst, float scale) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)src + off;
        int i = 0;
#ifdef HAVE_AVX2
        const __m256 sc = _mm256_set1_ps(scale);
        for (; i + 8 <= n; i += 8) { /* bf16 -> fp32: widen each to 32 bits, shift up 16 */
            __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + i)));
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)), sc));
        }
#endif
        for (; i < n; i++) dst[i] = bf16_to_f32(s[i]) * scale;
    } else {
        const float *s = (const float *)src + off;
        for (int i = 0; i < n; i++) dst[i] = s[i] * scale;
    }
}

static void store_row(void *dst, size_t off, int bf16, const float *src, int n, float scale) {
    if (bf16) {
        uint16_t *d = (uint16_t *)dst + off;
        for (int i = 0; i < n; i++) d[i] = f32_to_bf16(src[i] * scale);
    } else {
        float *d = (float *)dst + off;
        for (int i = 0; i < n; i++) d[i] = src[i] * scale;
    }
}

#ifdef __AVX512F__ /* attend_chunk: decode attention with AVX-512 (else attend_chunk_rows) */
/* s[t] = q · k_t for the n fp32 rows of kt [n, hd]; returns max(m, max_t s[t]). */
static float scores(const float *q, const float *kt, int n, int hd, float *s, float m) {
    int t = 0;
#ifdef __AVX512F__
    if (hd % 16 == 0) {
        for (; t + 4 <= n; t += 4) { /* four tokens at a time: four independent FMA chains */
            const float *k = kt + (size_t)t * hd;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int d = 0; d < hd; d += 16) {
                __m512 qv = _mm512_loadu_ps(q + d);
                a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + d), a0);
                a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + hd + d), a1);
                a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + 2 * hd + d), a2);
                a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + 3 * hd + d), a3);
            }
            s[t] = _mm512_reduce_add_ps(a0);
            s[t + 1] = _mm512_reduce_add_ps(a1);
            s[t + 2] = _mm512_reduce_add_ps(a2);
            s[t + 3] = _mm512_reduce_add_ps(a3);
        }
    }
#endif
    for (; t < n; t++) {
        const float *k = kt + (size_t)t * hd;
        float dot = 0.f;
        for (int d = 0; d < hd; d++) dot += q[d] * k[d];
        s[t] = dot;
    }
    for (t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    return m;
}

/* acc = acc · corr + Σ_t p[t] · v_t over the n fp32 rows of vt [n, hd]. */
static void accumulate(float *acc, float corr, const float *p, const float *vt, int n, int hd) {
#ifdef __AVX512F__
    if (hd % 16 == 0) { /* 16 dims at a time: their sums stay in one register */
        for (int d = 0; d < hd; d += 16) {
            __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(corr));
            for (int t = 0; t < n; t++)
                a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_loadu_ps(vt + (size_t)t * hd + d), a);
            _mm512_storeu_ps(acc + d, a);
        }
        return;
    }
#endif
    for (int d = 0; d < hd; d++) acc[d] *= corr;
    for (int t = 0; t < n; t++)
        for (int d = 0; d < hd; d++) acc[d] += p[t] * vt[(size_t)t * hd + d];
}

/* Tokens [t_begin, t_end) of one sequence, all heads: qf [kvh * rows, hd] (row j on head
 * j / rows) -> unnormalised acc [kvh * rows, hd], running max and sum [kvh * rows]. A block of
 * K/V is converted to fp32 once ([kvh, BLOCK, hd]) and shared by the head's rows. */
static void attend_chunk(const float *qf, int kvh, int rows, const void *k_cache,
                         const void *v_cache, int bf16, const int32_t *pages, int t_begin,
                         int t_end, int hd, int ps, float *acc, float *mx, float *sum, float *kb,
                         float *vb) {
    int n_rows = kvh * rows;
    float s[BLOCK];
    memset(acc, 0, sizeof(float) * (size_t)n_rows * hd);
    for (int j = 0; j < n_rows; j++) { mx[j] = -INFINITY; sum[j] = 0.f; }
    for (int t0 = t_begin; t0 < t_end; t0 += BLOCK) {
        int n = t_end - t0 < BLOCK ? t_end - t0 : BLOCK;
        for (int t = 0; t < n; t++) {
            int pos = t0 + t;
            size_t off = ((size_t)pages[pos / ps] * ps + pos % ps) * kvh * hd;
            for (int h = 0; h < kvh; h++) {
                load_row(k_cache, off + (size_t)h * hd, bf16, hd, kb + ((size_t)h * BLOCK + t) * hd, 1.f);
                load_row(v_cache, off + (size_t)h * hd, bf16, hd, vb + ((size_t)h * BLOCK + t) * hd, 1.f);
            }
        }
        for (int j = 0; j < n_rows; j++) {
            size_t head = (size_t)(j / rows) * BLOCK * hd;
            float m = scores(qf + (size_t)j * hd, kb + head, n, hd, s, mx[j]);
            float corr = exp_nonpos(mx[j] - m), l = sum[j] * corr;
            for (int t = 0; t < n; t++) {
                s[t] = exp_nonpos(s[t] - m);
                l += s[t];
            }
            accumulate(acc + (size_t)j * hd, corr, s, vb + head, n, hd);
            mx[j] = m;
            sum[j] = l;
        }
    }
}
#endif

/* s[t] = q · k_t and, with q2, s2[t] = q2 · k_t for the BLOCK keys of kt [hd][BLOCK]. */
static void scores_t2(const float *q, const float *q2, const float *kt, int hd, float *s,
                      float *s2) {
#if defined(HAVE_AVX2) && BLOCK == 32
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int d = 0; d < hd; d++) {
        const float *k = kt + (size_t)d * BLOCK;
        __m256 k0 = _mm256_loadu_ps(k), k1 = _mm256_loadu_ps(k + 8);
        __m256 k2 = _mm256_loadu_ps(k + 16), k3 = _mm256_loadu_ps(k + 24);
        __m256 qa = _mm256_broadcast_ss(q + d);
        a0 = _mm256_fmadd_ps(qa, k0, a0); a1 = _mm256_fmadd_ps(qa, k1, a1);
        a2 = _mm256_fmadd_ps(qa, k2, a2); a3 = _mm256_fmadd_ps(qa, k3, a3);
        if (q2) {
            __m256 qb = _mm256_broadcast_ss(q2 + d);
            b0 = _mm256_fmadd_ps(qb, k0, b0); b1 = _mm256_fmadd_ps(qb, k1, b1);
            b2 = _mm256_fmadd_ps(qb, k2, b2); b3 = _mm256_fmadd_ps(qb, k3, b3);
        }
    }
    _mm256_storeu_ps(s, a0); _mm256_storeu_ps(s + 8, a1);
    _mm256_storeu_ps(s + 16, a2); _mm256_storeu_ps(s + 24, a3);
    if (q2) {
        _mm256_storeu_ps(s2, b0); _mm256_storeu_ps(s2 + 8, b1);
        _mm256_storeu_ps(s2 + 16, b2); _mm256_storeu_ps(s2 + 24, b3);
    }
#else
    for (int t = 0; t < BLOCK; t++) s[t] = 0.f;
    for (int d = 0; d < hd; d++)
        for (int t = 0; t < BLOCK; t++) s[t] += q[d] * kt[(size_t)d * BLOCK + t];
    if (q2) {
        for (int t = 0; t < BLOCK; t++) s2[t] = 0.f;
        for (int d = 0; d < hd; d++)
            for (int t = 0; t < BLOCK; t++) s2[t] += q2[d] * kt[(size_t)d * BLOCK + t];
    }
#endif
}

/* One row's online softmax over its n scores s, then acc = acc · corr + Σ_t p[t] · v[t], v[t]
 * pointing at token t's V row (fp32, hd). */
static void softmax_pv(float *s, int n, const float *const *v, int hd, float *acc, float *mx,
                       float *sum) {
    float m = *mx;
    for (int t = 0; t < n; t++) m = s[t] > m ? s[t] : m;
    float corr = exp_nonpos(*mx - m), l = 0.f; /* *mx = -inf at the first block: 0 */
    for (int t = 0; t < n; t++) s[t] = exp_nonpos(s[t] - m);
    for (int t = 0; t < n; t++) l += s[t];
    *mx = m;
    *sum = *sum * corr + l;
    int d = 0;
#ifdef HAVE_AVX2
    const __m256 c = _mm256_set1_ps(corr);
    for (; d + 64 <= hd; d += 64) { /* 64 dims in eight registers over all n tokens */
        __m256 x[8];
        for (int u = 0; u < 8; u++) x[u] = _mm256_mul_ps(_mm256_loadu_ps(acc + d + 8 * u), c);
        for (int t = 0; t < n; t++) {
            __m256 pt = _mm256_broadcast_ss(s + t);
            const float *vt = v[t] + d;
            for (int u = 0; u < 8; u++) x[u] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vt + 8 * u), x[u]);
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(acc + d + 8 * u, x[u]);
    }
    for (; d + 8 <= hd; d += 8) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(acc + d), c);
        for (int t = 0; t < n; t++)
            x = _mm256_fmadd_ps(_mm256_broadcast_ss(s + t), _mm256_loadu_ps(v[t] + d), x);
        _mm256_storeu_ps(acc + d, x);
    }
#endif
    if (d < hd) {
        for (int e = d; e < hd; e++) acc[e] *= corr;
        for (int t = 0; t < n; t++)
            for (int e = d; e < hd; e++) acc[e] += s[t] * v[t][e];
    }
}

/* One KV head's causal attention, any dtype and CPU: query rows qf [rows, hd] (fp32, scaled)
 * over the keys [0, row_end[j]) of one sequence (row_end ascending within a block of rows is not
 * required), into unnormalised acc [rows, hd], running max and sum [rows]. Per block of BLOCK
 * keys, K is converted and transposed once to kt [hd][BLOCK] and V to vb [BLOCK][hd]; each row's
 * scores are then Σ_d q[d]·kt[d][·] and its V sum Σ_t p[t]·vb[t][·]: loops over contiguous
 * memory with no reductions, vectorised by the compiler. t_end: the largest row_end. */
static void attend_head_generic(const float *qf, int rows, const int *row_end, int h, int kvh,
                                const void *k_cache, const void *v_cache, int bf16,
                                const int32_t *pages, int t_end, int hd, int ps, float *acc,
                                float *mx, float *sum, float *kt, float *vb) {
    float s[BLOCK], s2[BLOCK];
    const float *vrow[BLOCK];
    for (int t = 0; t < BLOCK; t++) vrow[t] = vb + (size_t)t * hd;
    memset(acc, 0, sizeof(float) * (size_t)rows * hd);
    for (int j = 0; j < rows; j++) { mx[j] = -INFINITY; sum[j] = 0.f; }
    for (int t0 = 0; t0 < t_end; t0 += BLOCK) {
        int n = t_end - t0 < BLOCK ? t_end - t0 : BLOCK;
        for (int t = 0; t < n; t++) {
            int pos = t0 + t;
            size_t off = (((size_t)pages[pos / ps] * ps + pos % ps) * kvh + h) * hd;
            load_row(v_cache, off, bf16, hd, vb + (size_t)t * hd, 1.f);
            if (bf16) {
                const uint16_t *k = (const uint16_t *)k_cache + off;
                for (int d = 0; d < hd; d++) kt[(size_t)d * BLOCK + t] = bf16_to_f32(k[d]);
            } else {
                const float *k = (const float *)k_cache + off;
                for (int d = 0; d < hd; d++) kt[(size_t)d * BLOCK + t] = k[d];
            }
        }
        for (int t = n; t < BLOCK; t++) /* a short last block: finite scores, never used */
            for (int d = 0; d < hd; d++) kt[(size_t)d * BLOCK + t] = 0.f;
        for (int j = 0; j < rows; j++) {
            if (row_end[j] <= t0) continue;
            int nj = row_end[j] - t0 < n ? row_end[j] - t0 : n;
            if (j + 1 < rows && row_end[j + 1] > t0) { /* two rows share each loaded K vector */
                scores_t2(qf + (size_t)j * hd, qf + (size_t)(j + 1) * hd, kt, hd, s, s2);
                int nj2 = row_end[j + 1] - t0 < n ? row_end[j + 1] - t0 : n;
                softmax_pv(s, nj, vrow, hd, acc + (size_t)j * hd, mx + j, sum + j);
                softmax_pv(s2, nj2, vrow, hd, acc + (size_t)(j + 1) * hd, mx + j + 1, sum + j + 1);
                j++;
                continue;
            }
            scores_t2(qf + (size_t)j * hd, NULL, kt, hd, s, NULL);
            softmax_pv(s, nj, vrow, hd, acc + (size_t)j * hd, mx + j, sum + j);
        }
    }
}


#ifndef __AVX512F__
/* s[t] = q · k[t] for the n rows k[t] (fp32, hd each, wherever they lie). */
static void scores_rows(const float *q, const float *const *k, int n, int hd, float *s) {
    int t = 0;
#ifdef HAVE_AVX2
    if (hd % 8 == 0) {
        for (; t + 8 <= n; t += 8) { /* eight tokens: eight FMA chains, summed by one hadd tree */
            __m256 a[8];
            for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
            for (int d = 0; d < hd; d += 8) {
                __m256 qv = _mm256_loadu_ps(q + d);
                for (int u = 0; u < 8; u++)
                    a[u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[t + u] + d), a[u]);
            }
            /* each 128-bit half: the four partial sums of tokens 0-3 (lo) and 4-7 (hi) */
            __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
            __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
            _mm256_storeu_ps(s + t, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20),
                                                  _mm256_permute2f128_ps(lo, hi, 0x31)));
        }
    }
#endif
    for (; t < n; t++) {
        float dot = 0.f;
        for (int d = 0; d < hd; d++) dot += q[d] * k[t][d];
        s[t] = dot;
    }
}

/* attend_chunk without AVX-512: per block, every head's K and V rows copied (bf16 widened) into
 * kb, vb [BLOCK][kvh * hd], a token's heads at a time in the pool's order; then head by head,
 * each query row's scores eight tokens at a time and the V sum of the prefill path, 64 dims in
 * registers. From DRAM the copy in that order beat reading each head's fp32 rows in place
 * (three strided passes over the block): 0.8x against 0.9x the old kernel's time (Zen 3). */
static void attend_chunk_rows(const float *qf, int kvh, int rows, const void *k_cache,
                              const void *v_cache, int bf16, const int32_t *pages, int t_begin,
                              int t_end, int hd, int ps, float *acc, float *mx, float *sum,
                              float *kb, float *vb) {
    int n_rows = kvh * rows;
    size_t row = (size_t)kvh * hd; /* one token's K (or V), every head */
    float s[BLOCK];
    const float *kp[BLOCK], *vp[BLOCK];
    memset(acc, 0, sizeof(float) * (size_t)n_rows * hd);
    for (int j = 0; j < n_rows; j++) { mx[j] = -INFINITY; sum[j] = 0.f; }
    int page = t_begin / ps, slot = t_begin % ps; /* of the next token: no division per token */
    for (int t0 = t_begin; t0 < t_end; t0 += BLOCK) {
        int n = t_end - t0 < BLOCK ? t_end - t0 : BLOCK;
        for (int t = 0; t < n; t++) {
            size_t off = ((size_t)pages[page] * ps + slot) * row;
            if (++slot == ps) { slot = 0; page++; }
            load_row(k_cache, off, bf16, (int)row, kb + t * row, 1.f);
            load_row(v_cache, off, bf16, (int)row, vb + t * row, 1.f);
        }
        for (int h = 0; h < kvh; h++) {
            for (int t = 0; t < n; t++) {
                kp[t] = kb + t * row + (size_t)h * hd;
                vp[t] = vb + t * row + (size_t)h * hd;
            }
            for (int j = h * rows; j < (h + 1) * rows; j++) {
                scores_rows(qf + (size_t)j * hd, kp, n, hd, s);
                softmax_pv(s, n, vp, hd, acc + (size_t)j * hd, mx + j, sum + j);
            }
        }
    }
}
#endif

#ifdef __AVX512BF16__
#define TILE 16 /* tokens per tile of the bf16 path: one zmm lane each */
#define PREFETCH_TILES 1 /* how far ahead the bf16 path asks for K and V (fastest of 1-4) */

/* Ask for head h's K and V (bf16) of tokens [t, t_end) of one sequence to be brought into L2
 * ahead of their use. Decode attention is a stream of reads scattered over pages that the
 * hardware prefetcher does not follow from one page to the next: without this a core waits on
 * DRAM at every tile (bf16 decode attention ran at 14 GB/s, with it 25, on a 2-core EPYC whose
 * stream read is 40). Into L2 (prefetcht1), one tile ahead: whole decode steps, whose GEMMs
 * leave no KV in cache, took 0.64-0.80x the time of L1 prefetches two tiles ahead (16-128
 * decodes over 300-2,048 tokens, 2-core EPYC, 2026-12-04; L2 two tiles ahead 1.04-1.07x this,
 * L1 one tile ahead no better than two). Likely cause: a tile is 64 lines, more than the L1
 * can have outstanding, and L1 prefetches that wait for a free slot hold up the loads behind
 * them. The fp32 path is compute-bound here: prefetching gained it nothing. */
static inline void prefetch_kv(const uint16_t *k_cache, const uint16_t *v_cache,
                               const int32_t *pages, int t, int t_end, int ps, int kvh, int hd,
                               int h) {
    for (; t < t_end; t++) {
        size_t o = (((size_t)pages[t / ps] * ps + t % ps) * kvh + h) * hd;
        for (int b = 0; b < hd; b += 32) { /* 32 bf16: one 64-byte line */
            __builtin_prefetch(k_cache + o + b, 0, 2);
            __builtin_prefetch(v_cache + o + b, 0, 2);
        }
    }
}

/* exp(x) for x <= 0, 16 lanes: the polynomial of exp_nonpos, 2^n applied by scalef. */
static inline __m512 exp512_nonpos(__m512 x) {
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* In-register transpose of 16 rows of 16 32-bit elements: r[i][j] -> r[j][i]. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* u[4i + c], 128-bit lane L: rows 4i..4i+3 of column 4L + c */
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) { /* a 4 x 4 transpose of 128-bit lanes */
        __m512i ab_lo = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
        __m512i ab_hi = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
        __m512i cd_lo = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
        __m512i cd_hi = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
        r[c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + c] = _mm512_shuffle_i32x4(ab_lo, cd_lo, _MM_SHUFFLE(3, 1, 3, 1));
        r[8 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + c] = _mm512_shuffle_i32x4(ab_hi, cd_hi, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* permutex2var indices interleaving two rows a, b of 32 bf16: (a_i, b_i) for i = 0..15, and
 * for i = 16..31 (b's elements are 32 + i). */
static const uint16_t INTERLEAVE_LO[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                           8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const uint16_t INTERLEAVE_HI[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                           24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

/* acc = acc · corr + Σ_k (p_2k v_2k + p_2k+1 v_2k+1) over `npairs` token pairs: pp[k] holds
 * (p_2k, p_2k+1) in bf16, vi [npairs][hd][2] the two tokens' V interleaved; hd a multiple of 32,
 * 64 or 32 dims at a time (independent vdpbf16ps chains). */
static inline void pv_accumulate_bf16(float *acc, float corr, const uint32_t *pp,
                                      const uint16_t *vi, int npairs, int hd) {
    const __m512 c = _mm512_set1_ps(corr);
    int d = 0;
    for (; d + 64 <= hd; d += 64) {
        __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(acc + d), c);
        __m512 x1 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 16), c);
        __m512 x2 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 32), c);
        __m512 x3 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 48), c);
        for (int k = 0; k < npairs; k++) {
            const uint16_t *v = vi + ((size_t)k * hd + d) * 2;
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[k]);
            x0 = _mm512_dpbf16_ps(x0, w, (__m512bh)_mm512_loadu_si512(v));
            x1 = _mm512_dpbf16_ps(x1, w, (__m512bh)_mm512_loadu_si512(v + 32));
            x2 = _mm512_dpbf16_ps(x2, w, (__m512bh)_mm512_loadu_si512(v + 64));
            x3 = _mm512_dpbf16_ps(x3, w, (__m512bh)_mm512_loadu_si512(v + 96));
        }
        _mm512_storeu_ps(acc + d, x0);
        _mm512_storeu_ps(acc + d + 16, x1);
        _mm512_storeu_ps(acc + d + 32, x2);
        _mm512_storeu_ps(acc + d + 48, x3);
    }
    if (d < hd) { /* hd % 64 == 32 */
        __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(acc + d), c);
        __m512 x1 = _mm512_mul_ps(_mm512_loadu_ps(acc + d + 16), c);
        for (int k = 0; k < npairs; k++) {
            const uint16_t *v = vi + ((size_t)k * hd + d) * 2;
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[k]);
            x0 = _mm512_dpbf16_ps(x0, w, (__m512bh)_mm512_loadu_si512(v));
            x1 = _mm512_dpbf16_ps(x1, w, (__m512bh)_mm512_loadu_si512(v + 32));
        }
        _mm512_storeu_ps(acc + d, x0);
        _mm512_storeu_ps(acc + d + 16, x1);
    }
}

/* pv_accumulate_bf16 for nr (2 or 3) rows at once: each V pair loaded once serves them all, and
 * their 2·nr dpbf16 chains hide each other's latency. npairs: the longest row's (P is zero past
 * a row's own tokens). Inlined with a constant nr: the loops over rows unroll into registers. */
static inline void pv_accumulate_rows_bf16(float *const *acc, const float *corr,
                                           const uint32_t (*pp)[TILE / 2], int nr,
                                           const uint16_t *vi, int npairs, int hd) {
    for (int d = 0; d < hd; d += 32) {
        __m512 x0[3], x1[3];
        for (int r = 0; r < nr; r++) {
            const __m512 c = _mm512_set1_ps(corr[r]);
            x0[r] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d), c);
            x1[r] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + d + 16), c);
        }
        for (int k = 0; k < npairs; k++) {
            const uint16_t *v = vi + ((size_t)k * hd + d) * 2;
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(v), v1 = (__m512bh)_mm512_loadu_si512(v + 32);
            for (int r = 0; r < nr; r++) {
                __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp[r][k]);
                x0[r] = _mm512_dpbf16_ps(x0[r], w, v0);
                x1[r] = _mm512_dpbf16_ps(x1[r], w, v1);
            }
        }
        for (int r = 0; r < nr; r++) {
            _mm512_storeu_ps(acc[r] + d, x0[r]);
            _mm512_storeu_ps(acc[r] + d + 16, x1[r]);
        }
    }
}

/* The scaled scores of nr (1-3) query rows q[r] against a tile's transposed K kt [hd/2 pairs]
 * [16 tokens], -inf past each row's valid tokens: bf16 pair dot products (vdpbf16ps), four
 * chains a row, each K pair loaded once for every row. Inlined with a constant nr. */
static inline void tile_scores(const uint32_t *const *q, int nr, const uint32_t *kt, int pairs,
                               float scale, const __mmask16 *valid, __m512 *sc) {
    __m512 a[3][4];
    for (int r = 0; r < nr; r++)
        for (int u = 0; u < 4; u++) a[r][u] = _mm512_setzero_ps();
    for (int i = 0; i < pairs; i += 4)
        for (int u = 0; u < 4; u++) {
            __m512bh k = (__m512bh)_mm512_loadu_si512(kt + (size_t)(i + u) * TILE);
            for (int r = 0; r < nr; r++)
                a[r][u] = _mm512_dpbf16_ps(a[r][u], (__m512bh)_mm512_set1_epi32((int)q[r][i + u]), k);
        }
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < nr; r++) {
        __m512 x = _mm512_add_ps(_mm512_add_ps(a[r][0], a[r][1]), _mm512_add_ps(a[r][2], a[r][3]));
        sc[r] = _mm512_mask_blend_ps(valid[r], ninf, _mm512_mul_ps(x, vscale));
    }
}

/* One row's online softmax step over a tile's scores sc: updates its running max and sum,
 * writes P (rounded to bf16, as flash attention does on GPUs) as token pairs into pp, and
 * returns the factor its accumulated V sum must be scaled by. The sum adds the rounded values,
 * so the weights still sum to one. */
static inline float tile_softmax(__m512 sc, __mmask16 valid, float *mx, float *sum, uint32_t *pp) {
    float m = _mm512_reduce_max_ps(sc);
    m = m > *mx ? m : *mx;
    /* exp(*mx - m): 1 while the max holds (most tiles), 0 at the first (*mx = -inf) */
    float corr = m == *mx ? 1.f : *mx == -INFINITY ? 0.f : expf(*mx - m);
    __m512 e = _mm512_maskz_mov_ps(valid, exp512_nonpos(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
    __m256i pb = (__m256i)_mm512_cvtneps_pbh(e);
    __m512 er = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16));
    *sum = *sum * corr + _mm512_reduce_add_ps(er);
    *mx = m;
    _mm256_storeu_si256((__m256i *)pp, pb);
    return corr;
}

/* The tile of tokens [t0, min(t0 + TILE, t_end)) of head h, its page and slot at *page, *slot
 * (advanced past it): asks for the next PREFETCH_TILES tiles (the first tile too, at t_begin;
 * each asked for more than once: fewer of them dropped), then lays the tile out for the tile
 * math: K transposed into kt [hd/2 pairs][TILE] (tokens past the tile zero), V interleaved by
 * token pairs into vi [TILE / 2][hd][2] (pairs past the tile zero: AMX sums every pair).
 * Returns the tile's token count. */
static inline int next_tile(const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *pages, int t_begin, int t0, int t_end, int ps, int kvh,
                            int hd, int h, int *page, int *slot, uint32_t *kt, uint16_t *vi) {
    int n = t_end - t0 < TILE ? t_end - t0 : TILE;
    int pf = t0 == t_begin ? t0 : t0 + TILE;
    int pf_end = t0 + (PREFETCH_TILES + 1) * TILE < t_end ? t0 + (PREFETCH_TILES + 1) * TILE : t_end;
    prefetch_kv(k_cache, v_cache, pages, pf, pf_end, ps, kvh, hd, h);
    size_t off[TILE];
    for (int t = 0; t < n; t++) { /* consecutive positions: walk the page table */
        off[t] = (((size_t)pages[*page] * ps + *slot) * kvh + h) * hd;
        if (++*slot == ps) { *slot = 0; ++*page; }
    }
    for (int c = 0; c < hd / 2; c += 16) { /* K pairs c..c+15 of the tile's tokens */
        __m512i r[16];
        for (int t = 0; t < TILE; t++)
            r[t] = t < n ? _mm512_loadu_si512(k_cache + off[t] + 2 * c) : _mm512_setzero_si512();
        transpose16(r);
        for (int i = 0; i < 16; i++) _mm512_storeu_si512(kt + (size_t)(c + i) * TILE, r[i]);
    }
    const __m512i lo = _mm512_loadu_si512(INTERLEAVE_LO), hi = _mm512_loadu_si512(INTERLEAVE_HI);
    for (int t = 0; t < n; t += 2) { /* V of tokens t, t+1 interleaved: vdpbf16ps pairs */
        const uint16_t *va = v_cache + off[t];
        const uint16_t *vn = t + 1 < n ? v_cache + off[t + 1] : NULL;
        for (int d = 0; d < hd; d += 32) {
            __m512i a = _mm512_loadu_si512(va + d);
            __m512i b = vn ? _mm512_loadu_si512(vn + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(vi + ((size_t)(t / 2) * hd + d) * 2, _mm512_permutex2var_epi16(a, lo, b));
            _mm512_storeu_si512(vi + ((size_t)(t / 2) * hd + d + 16) * 2, _mm512_permutex2var_epi16(a, hi, b));
        }
    }
    if (n < TILE) memset(vi + (size_t)((n + 1) / 2) * hd * 2, 0, sizeof(uint16_t) * (TILE - n - n % 2) * hd);
    return n;
}

/* One KV head's attention for bf16 with hd a multiple of 32 on a CPU with AVX512-BF16: query
 * rows q [rows, hd] (unscaled) over the keys [t_begin, t_end) of one sequence, row j stopping at
 * row_end[j] (exclusive; NULL: all at t_end), into unnormalised acc [rows, hd], running max and
 * sum [rows]. Tiles of 16 tokens, one per lane: the head's K tile is transposed to [hd/2 pairs]
 * [16 tokens], so a row's 16 scores are bf16 pair dot products (vdpbf16ps: exact products, fp32
 * sums) with no horizontal sums; the tile's V is interleaved by token pairs once and shared by
 * every row, whose weighted sum of V is vdpbf16ps too (P rounded to bf16, as flash attention
 * does on GPUs). kt: [hd/2][TILE] uint32 scratch; vb: TILE × hd floats of scratch. */
static void attend_head_bf16(const uint16_t *q, int rows, const int *row_end, float scale, int h,
                             int kvh, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int32_t *pages, int t_begin, int t_end, int hd, int ps,
                             float *acc, float *mx, float *sum, uint32_t *kt, float *vb) {
    int pairs = hd / 2;
    uint32_t pp[3][TILE / 2]; /* each row's P of tokens 2k, 2k+1 as one bf16 pair */
    uint16_t *vi = (uint16_t *)vb; /* [TILE / 2][hd][2] bf16: V of token pairs, interleaved */
    memset(acc, 0, sizeof(float) * (size_t)rows * hd);
    for (int j = 0; j < rows; j++) { mx[j] = -INFINITY; sum[j] = 0.f; }
    int page = t_begin / ps, slot = t_begin % ps;
    for (int t0 = t_begin; t0 < t_end; t0 += TILE) {
        int n = next_tile(k_cache, v_cache, pages, t_begin, t0, t_end, ps, kvh, hd, h, &page, &slot,
                          kt, vi);
        int active = rows; /* rows that read this tile */
        for (int j = 0; row_end && j < rows; j++) active -= row_end[j] <= t0;
        /* Rows three at a time (two where four are left, so no row runs alone): each K and V
         * load serves them all, and a lone row's four dpbf16 chains wait on their latency. */
        for (int j = 0; active > 0;) {
            int nr = active == 4 || active == 2 ? 2 : active == 1 ? 1 : 3;
            int idx[3], len[3];
            for (int r = 0; r < nr; j++) {
                if (row_end && row_end[j] <= t0) continue;
                idx[r] = j;
                len[r++] = row_end && row_end[j] - t0 < n ? row_end[j] - t0 : n;
            }
            active -= nr;
            const uint32_t *qr[3];
            float *ar[3], corr[3];
            __mmask16 mask[3];
            __m512 sc[3];
            int longest = 0;
            for (int r = 0; r < nr; r++) {
                qr[r] = (const uint32_t *)(q + (size_t)idx[r] * hd);
                ar[r] = acc + (size_t)idx[r] * hd;
                mask[r] = (__mmask16)((1u << len[r]) - 1);
                longest = len[r] > longest ? len[r] : longest;
            }
            if (nr == 1) {
                tile_scores(qr, 1, kt, pairs, scale, mask, sc);
                corr[0] = tile_softmax(sc[0], mask[0], mx + idx[0], sum + idx[0], pp[0]);
                pv_accumulate_bf16(ar[0], corr[0], pp[0], vi, (len[0] + 1) / 2, hd);
                continue;
            }
            if (nr == 2) tile_scores(qr, 2, kt, pairs, scale, mask, sc);
            else tile_scores(qr, 3, kt, pairs, scale, mask, sc);
            for (int r = 0; r < nr; r++)
                corr[r] = tile_softmax(sc[r], mask[r], mx + idx[r], sum + idx[r], pp[r]);
            if (nr == 2) pv_accumulate_rows_bf16(ar, corr, pp, 2, vi, (longest + 1) / 2, hd);
            else pv_accumulate_rows_bf16(ar, corr, pp, 3, vi, (longest + 1) / 2, hd);
        }
    }
}

#if HAVE_AMX
/* attend_head_bf16 on AMX tiles: the same tiles of 16 tokens, K transposed and V interleaved the
 * same way, but a block of 16 query rows' scores is one tile product per 32 dims (S = Q · Kᵀ, the
 * transposed K being the B tile's pair layout) and their P · V one per 16 dims (V's token pairs
 * likewise), in place of a vdpbf16ps per row, pair and 16 lanes. P is rounded to bf16 as there;
 * each row's scores and sums come out the same whatever rows run with it (a tile's rows are
 * independent), but not bit-equal to attend_head_bf16's: a CPU takes one path for every step.
 * Tiles (amx_configure_attention): 0-3 P·V sums (16 rows x 16 fp32), 4 Q (16 rows x 32 dims),
 * 5 Kᵀ (16 pairs x 16 tokens), 6 P (16 rows x 16 tokens), 7 V (8 token pairs x 16 dims); the
 * scores use tile 0 before P·V does. scratch: amx_scratch_floats(rows, hd) floats. */
static void amx_configure_attention(void) {
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 8};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 32, 64};
    amx_configure(rows, colsb);
}

static size_t amx_scratch_floats(int rows, int hd) {
    size_t blocks = (size_t)(rows + 15) / 16;
    /* q copy (bf16), scores, P (bf16), rescale factors, one block's P·V, Kᵀ, V pairs */
    return blocks * 16 * hd / 2 + blocks * 16 * TILE + blocks * 16 * TILE / 2 + blocks * 16
           + (size_t)16 * 64 + (size_t)hd * TILE / 2 + (size_t)hd * TILE / 2;
}

static void attend_head_amx(const uint16_t *q, int rows, const int *row_end, float scale, int h,
                            int kvh, const uint16_t *k_cache, const uint16_t *v_cache,
                            const int32_t *pages, int t_begin, int t_end, int hd, int ps,
                            float *acc, float *mx, float *sum, float *scratch) {
    int blocks = (rows + 15) / 16, padded = blocks * 16;
    uint16_t *qp = (uint16_t *)scratch;                     /* [padded][hd] */
    float *sc = scratch + (size_t)padded * hd / 2;          /* [padded][TILE] */
    uint16_t *pm = (uint16_t *)(sc + (size_t)padded * TILE); /* [padded][TILE] */
    float *corr = (float *)(pm + (size_t)padded * TILE);    /* [padded] */
    float *pv = corr + padded;                              /* [16][64] */
    uint32_t *kt = (uint32_t *)(pv + 16 * 64);              /* [hd/2][TILE] */
    uint16_t *vi = (uint16_t *)(kt + (size_t)hd / 2 * TILE); /* [TILE/2][hd][2] */
    memcpy(qp, q, sizeof(uint16_t) * (size_t)rows * hd);
    memset(qp + (size_t)rows * hd, 0, sizeof(uint16_t) * (size_t)(padded - rows) * hd);
    memset(acc, 0, sizeof(float) * (size_t)rows * hd);
    for (int j = 0; j < rows; j++) { mx[j] = -INFINITY; sum[j] = 0.f; }
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    int page = t_begin / ps, slot = t_begin % ps;
    for (int t0 = t_begin; t0 < t_end; t0 += TILE) {
        int n = next_tile(k_cache, v_cache, pages, t_begin, t0, t_end, ps, kvh, hd, h, &page, &slot,
                          kt, vi);
        /* rows that end before this tile (a prefill block's first rows) are done: a block of
         * them is skipped, a row of them adds nothing (P zero, factor one) */
        int first = 0;
        while (row_end && first < rows && row_end[first] <= t0) first++;
        for (int b = first / 16; b < blocks; b++) {
            _tile_zero(0);
            for (int c = 0; c < hd / 32; c++) {
                _tile_loadd(4, qp + (size_t)b * 16 * hd + c * 32, hd * (int)sizeof(uint16_t));
                _tile_loadd(5, kt + (size_t)c * 16 * TILE, TILE * 4);
                _tile_dpbf16ps(0, 4, 5);
            }
            _tile_stored(0, sc + (size_t)b * 16 * TILE, TILE * 4);
        }
        for (int r = first / 16 * 16; r < padded; r++) {
            int len = r >= rows || (row_end && row_end[r] <= t0) ? 0
                      : row_end && row_end[r] - t0 < n ? row_end[r] - t0 : n;
            if (len == 0) {
                memset(pm + (size_t)r * TILE, 0, sizeof(uint16_t) * TILE);
                corr[r] = 1.f;
                continue;
            }
            __mmask16 valid = (__mmask16)((1u << len) - 1);
            __m512 s16 = _mm512_mask_blend_ps(valid, ninf,
                                              _mm512_mul_ps(_mm512_loadu_ps(sc + (size_t)r * TILE), vscale));
            corr[r] = tile_softmax(s16, valid, mx + r, sum + r, (uint32_t *)(pm + (size_t)r * TILE));
        }
        for (int b = first / 16; b < blocks; b++) {
            int r_end = (b + 1) * 16 < rows ? (b + 1) * 16 : rows;
            _tile_loadd(6, pm + (size_t)b * 16 * TILE, TILE * (int)sizeof(uint16_t));
            for (int d0 = 0; d0 < hd; d0 += 64) {
                int wide = hd - d0 >= 64; /* four 16-dim tiles, else two (hd % 64 == 32) */
                _tile_zero(0); _tile_zero(1);
                _tile_loadd(7, vi + (size_t)d0 * 2, hd * 4);
                _tile_dpbf16ps(0, 6, 7);
                _tile_loadd(7, vi + (size_t)(d0 + 16) * 2, hd * 4);
                _tile_dpbf16ps(1, 6, 7);
                _tile_stored(0, pv, 64 * 4);
                _tile_stored(1, pv + 16, 64 * 4);
                if (wide) {
                    _tile_zero(2); _tile_zero(3);
                    _tile_loadd(7, vi + (size_t)(d0 + 32) * 2, hd * 4);
                    _tile_dpbf16ps(2, 6, 7);
                    _tile_loadd(7, vi + (size_t)(d0 + 48) * 2, hd * 4);
                    _tile_dpbf16ps(3, 6, 7);
                    _tile_stored(2, pv + 32, 64 * 4);
                    _tile_stored(3, pv + 48, 64 * 4);
                }
                for (int r = b * 16; r < r_end; r++) {
                    float *a = acc + (size_t)r * hd + d0;
                    const float *p = pv + (size_t)(r - b * 16) * 64;
                    const __m512 c = _mm512_set1_ps(corr[r]);
                    for (int d = 0; d < (wide ? 64 : 32); d += 16)
                        _mm512_storeu_ps(a + d, _mm512_fmadd_ps(_mm512_loadu_ps(a + d), c, _mm512_loadu_ps(p + d)));
                }
            }
        }
    }
}
#endif

/* attend_chunk for bf16 (see attend_head_bf16): every head of one sequence, all rows to t_end;
 * q: bf16 [kvh * rows, hd], unscaled. On the AVX-512 tiles on every CPU: a decode's few rows a
 * KV head fill a sixteenth of an AMX tile (AMX measured 1.12-1.13x slower here, 2-core Xeon).
 * Nor did AMX pay with the scores transposed, Sᵀ = K · Qᵀ (a page's K rows an A tile where they
 * lie, no transpose; P · V a tile product, its sums kept in tiles across 32-token blocks): on a
 * 2-core Xeon with AMX, 64 decodes over 300 tokens took 0.94x the time of these tiles with the
 * context in cache and 1.00x from memory (bench/cpu_decode_attention.py, 2026-12-05), gathering
 * each row's scores out of Sᵀ for the softmax costing a quarter of it. Reading a tile's heads
 * in turn (tokens outer) instead of a head's tiles: 1.00x; prefetching every head's lines in
 * the first head's pass: 1.41x slower from memory; two or four tiles ahead: 1.04x, 1.17x. */
static void attend_chunk_bf16(const uint16_t *q, float scale, int kvh, int rows,
                              const uint16_t *k_cache, const uint16_t *v_cache,
                              const int32_t *pages, int t_begin, int t_end, int hd, int ps,
                              float *acc, float *mx, float *sum, uint32_t *kt, float *vb) {
    for (int h = 0; h < kvh; h++)
        attend_head_bf16(q + (size_t)h * rows * hd, rows, NULL, scale, h, kvh, k_cache, v_cache,
                         pages, t_begin, t_end, hd, ps, acc + (size_t)h * rows * hd,
                         mx + h * rows, sum + h * rows, kt, vb);
}

#endif

/* Scratch floats for attend_head_amx where this CPU runs it on rows x hd (bf16, hd a multiple of
 * 32; Linux lets us use the tiles), else 0. */
static size_t amx_attention(int bf16, int rows, int hd) {
#if HAVE_AMX
    if (bf16 && hd % 32 == 0 && amx_permitted()) return amx_scratch_floats(rows, hd);
#endif
    (void)bf16; (void)rows; (void)hd;
    return 0;
}

/* q: [seqs, kvh, rows, hd]; k_cache, v_cache: [pages, ps, kvh, hd]; table: [seqs, max_pages];
 * lens: [seqs] context lengths; out: [seqs, kvh, rows, hd] (q's dtype); lse: [seqs, kvh, rows]
 * natural-log log-sum-exp of the scaled scores (-inf for an empty context). Returns 0, or -1 when
 * out of memory. */
int paged_decode(const void *q, int rows, const void *k_cache, const void *v_cache,
                 const int32_t *table, int max_pages, const int32_t *lens, int seqs, int kvh,
                 int hd, int ps, float scale, int chunk, int bf16, int threads, void *out,
                 float *lse) {
    int n_rows = kvh * rows;
    size_t part = (size_t)n_rows * (hd + 2); /* one chunk's partial: acc, max, sum */
    /* work items: chunks; chunks first[s] .. first[s + 1] - 1 belong to sequence s */
    int64_t *first = malloc(sizeof(int64_t) * ((size_t)seqs + 1));
    if (!first) return -1;
    first[0] = 0;
    for (int s = 0; s < seqs; s++)
        first[s + 1] = first[s] + (lens[s] > chunk ? (lens[s] + chunk - 1) / chunk : 1);
    int64_t n_items = first[seqs];
    float *parts = NULL; /* partials of split sequences, merged afterwards */
    if (n_items > seqs && !(parts = malloc(sizeof(float) * part * (size_t)n_items))) {
        free(first);
        return -1;
    }
    int failed = 0;
    #pragma omp parallel num_threads(threads)
    {
        float *qf = malloc(sizeof(float) * (size_t)n_rows * hd);
        float *acc = malloc(sizeof(float) * part);
        float *kb = malloc(sizeof(float) * BLOCK * (size_t)kvh * hd);
        float *vb = malloc(sizeof(float) * BLOCK * (size_t)kvh * hd);
        if (!qf || !acc || !kb || !vb) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp barrier
        int s = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t c = 0; c < n_items; c++) {
            if (failed) continue;
            while (first[s + 1] <= c) s++; /* a thread's items ascend: s only moves forward */
            while (first[s] > c) s--;
            int t_begin = (int)(c - first[s]) * chunk;
            int t_end = t_begin + chunk < lens[s] ? t_begin + chunk : lens[s];
            float *mx = acc + (size_t)n_rows * hd, *sum = mx + n_rows;
#ifdef __AVX512BF16__
            if (bf16 && hd % 32 == 0) {
                attend_chunk_bf16((const uint16_t *)q + (size_t)s * n_rows * hd, scale, kvh, rows,
                                  k_cache, v_cache, table + (size_t)s * max_pages, t_begin, t_end,
                                  hd, ps, acc, mx, sum, (uint32_t *)kb, vb);
            } else
#endif
            {
                load_row(q, (size_t)s * n_rows * hd, bf16, n_rows * hd, qf, scale);
#ifdef __AVX512F__
                attend_chunk(qf, kvh, rows, k_cache, v_cache, bf16, table + (size_t)s * max_pages,
                             t_begin, t_end, hd, ps, acc, mx, sum, kb, vb);
#else
                attend_chunk_rows(qf, kvh, rows, k_cache, v_cache, bf16,
                                  table + (size_t)s * max_pages, t_begin, t_end, hd, ps, acc, mx,
                                  sum, kb, vb);
#endif
            }
            if (first[s + 1] - first[s] > 1) {
                memcpy(parts + (size_t)c * part, acc, sizeof(float) * part);
                continue;
            }
            for (int j = 0; j < n_rows; j++) {
                store_row(out, ((size_t)s * n_rows + j) * hd, bf16, acc + (size_t)j * hd, hd,
                          sum[j] > 0.f ? 1.f / sum[j] : 0.f);
                lse[(size_t)s * n_rows + j] = sum[j] > 0.f ? mx[j] + logf(sum[j]) : -INFINITY;
            }
        }
        if (parts && !failed) {
            #pragma omp for schedule(dynamic, 1)
            for (int ss = 0; ss < seqs; ss++) {
                if (first[ss + 1] - first[ss] < 2) continue;
                for (int j = 0; j < n_rows; j++) {
                    float m = -INFINITY, l = 0.f;
                    for (int64_t c = first[ss]; c < first[ss + 1]; c++) {
                        float pm = parts[(size_t)c * part + (size_t)n_rows * hd + j];
                        m = pm > m ? pm : m;
                    }
                    memset(acc, 0, sizeof(float) * hd);
                    for (int64_t c = first[ss]; c < first[ss + 1]; c++) {
                        const float *p = parts + (size_t)c * part;
                        float pm = p[(size_t)n_rows * hd + j], psum = p[(size_t)n_rows * (hd + 1) + j];
                        if (psum <= 0.f) continue;
                        float w = expf(pm - m);
                        l += psum * w;
                        for (int d = 0; d < hd; d++) acc[d] += w * p[(size_t)j * hd + d];
                    }
                    store_row(out, ((size_t)ss * n_rows + j) * hd, bf16, acc, hd, l > 0.f ? 1.f / l : 0.f);
                    lse[(size_t)ss * n_rows + j] = l > 0.f ? m + logf(l) : -INFINITY;
                }
            }
        }
        free(qf); free(acc); free(kb); free(vb);
    }
    free(parts);
    free(first);
    return failed ? -1 : 0;
}

/* Prefill attention over the paged pool, causal. q: [T, kvh, g, hd], the T tokens of `seqs`
 * chunks one after another (chunk s is tokens q_start[s] .. q_start[s + 1] - 1); chunk s's
 * token i sits at position kv_lens[s] - q_len + i and attends to the keys at positions 0 .. its
 * own, read through table[s] (its K/V are already in the pool). out: [T, kvh, g, hd], q's dtype.
 * A work item is a block of QBLOCK tokens of one chunk on one KV head: its QBLOCK × g query rows
 * share every K/V tile they read (flash attention's outer loop over query blocks). bf16 with
 * AVX512-BF16 and hd a multiple of 32 runs attend_head_bf16, anything else attend_head_generic.
 * Returns 0, or -1 when out of memory. */
#define QBLOCK 32

int paged_prefill_supported(int bf16, int hd) {
    (void)bf16; (void)hd;
    return 1;
}

static int prefill_fast(int bf16, int hd) {
#ifdef __AVX512BF16__
    return bf16 && hd % 32 == 0;
#else
    (void)bf16; (void)hd;
    return 0;
#endif
}

int paged_prefill(const void *q, const int32_t *q_start, const int32_t *kv_lens, int seqs,
                  const void *k_cache, const void *v_cache, const int32_t *table, int max_pages,
                  int kvh, int g, int hd, int ps, float scale, int bf16, int threads, void *out) {
    int fast = prefill_fast(bf16, hd);
    int64_t *first = malloc(sizeof(int64_t) * ((size_t)seqs + 1)); /* items of chunk s */
    if (!first) return -1;
    first[0] = 0;
    for (int s = 0; s < seqs; s++) {
        int q_len = q_start[s + 1] - q_start[s];
        first[s + 1] = first[s] + (int64_t)kvh * ((q_len + QBLOCK - 1) / QBLOCK);
    }
    int64_t n_items = first[seqs];
    int rows = QBLOCK * g, failed = 0;
    size_t esize = bf16 ? sizeof(uint16_t) : sizeof(float);
    size_t amx_floats = amx_attention(bf16, rows, hd);
    #pragma omp parallel num_threads(threads)
    {
        /* the block's queries: bf16 as they are (fast path), else fp32 and scaled */
        void *qs = malloc((fast ? sizeof(uint16_t) : sizeof(float)) * (size_t)rows * hd);
        float *acc = malloc(sizeof(float) * (size_t)rows * (hd + 2));
        float *kt = malloc(sizeof(float) * (size_t)hd * BLOCK); /* TILE × hd/2 pairs fit too */
        float *vb = malloc(sizeof(float) * (size_t)BLOCK * hd);
        int *row_end = malloc(sizeof(int) * (size_t)rows);
        float *amx = amx_floats ? malloc(sizeof(float) * amx_floats) : NULL;
        if (!qs || !acc || !kt || !vb || !row_end || (amx_floats && !amx)) {
            #pragma omp atomic write
            failed = 1;
        }
#if HAVE_AMX
        if (amx) amx_configure_attention();
#endif
        #pragma omp barrier
        /* later items of a chunk read more keys: hand them out first (dynamic, reversed) */
        #pragma omp for schedule(dynamic, 1)
        for (int64_t it = n_items - 1; it >= 0; it--) {
            if (failed) continue;
            int s = 0;
            while (first[s + 1] <= it) s++;
            int64_t k = it - first[s];
            int h = (int)(k % kvh), b = (int)(k / kvh);
            int q_len = q_start[s + 1] - q_start[s];
            int base = kv_lens[s] - q_len; /* position of the chunk's first token */
            int t_lo = b * QBLOCK, t_hi = t_lo + QBLOCK < q_len ? t_lo + QBLOCK : q_len;
            int n_rows = (t_hi - t_lo) * g;
            for (int i = t_lo; i < t_hi; i++) {
                size_t src = (((size_t)(q_start[s] + i) * kvh + h) * g) * hd;
                if (fast)
                    memcpy((uint16_t *)qs + (size_t)(i - t_lo) * g * hd,
                           (const char *)q + src * esize, esize * (size_t)g * hd);
                else
                    load_row(q, src, bf16, g * hd, (float *)qs + (size_t)(i - t_lo) * g * hd, scale);
                for (int j = 0; j < g; j++) row_end[(i - t_lo) * g + j] = base + i + 1;
            }
            float *mx = acc + (size_t)rows * hd, *sum = mx + rows;
#if HAVE_AMX
            if (amx)
                attend_head_amx((const uint16_t *)qs, n_rows, row_end, scale, h, kvh,
                                (const uint16_t *)k_cache, (const uint16_t *)v_cache,
                                table + (size_t)s * max_pages, 0, base + t_hi, hd, ps, acc, mx,
                                sum, amx);
            else
#endif
#ifdef __AVX512BF16__
            if (fast)
                attend_head_bf16((const uint16_t *)qs, n_rows, row_end, scale, h, kvh,
                                 (const uint16_t *)k_cache, (const uint16_t *)v_cache,
                                 table + (size_t)s * max_pages, 0, base + t_hi, hd, ps, acc, mx,
                                 sum, (uint32_t *)kt, vb);
            else
#endif
                attend_head_generic((const float *)qs, n_rows, row_end, h, kvh, k_cache, v_cache,
                                    bf16, table + (size_t)s * max_pages, base + t_hi, hd, ps,
                                    acc, mx, sum, kt, vb);
            for (int r = 0; r < n_rows; r++) {
                int i = t_lo + r / g, j = r % g;
                store_row(out, (((size_t)(q_start[s] + i) * kvh + h) * g + j) * hd, bf16,
                          acc + (size_t)r * hd, hd, sum[r] > 0.f ? 1.f / sum[r] : 0.f);
            }
        }
#if HAVE_AMX
        if (amx) _tile_release();
#endif
        free(qs); free(acc); free(kt); free(vb); free(row_end); free(amx);
    }
    free(first);
    return failed ? -1 : 0;
}
