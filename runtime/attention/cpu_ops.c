/* The CPU engine's other hot loops, beside the attention of paged_decode.c (built with it into one
 * library by cpu_kernel.py): the layer's fused bf16 elementwise ops and the greedy sampler's
 * argmax. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_common.h"

/* ---- The layer's elementwise ops in bf16, fused (runtime/model.py on a CPU) ----------------
 * Each replaces a chain of torch ops that round every intermediate to bf16 and cost a pass over
 * memory and a dispatch apiece (an RMSNorm was five, a RoPE seven). The roundings are kept where
 * torch makes them: RoPE and SiLU·up match the chains to the bit; the RMSNorm adds its squares
 * in another order than torch's reduction, so now and then a value rounds the other way (a
 * model's greedy bf16 outputs can then part from the chains', as they part between batchings;
 * its logits are as far from an fp32 run's). Rows in parallel. */

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* exp(x) for |x| <= 87 to about an ulp, f in [-1/2, 1/2]: SiLU rounds as torch's exp does. */
static inline float exp_ulp(float x) {
    x = x < -87.f ? -87.f : x > 87.f ? 87.f : x; /* not fminf/fmaxf: those do not vectorise */
    float t = x * 1.44269504f;
    float n = rintf(t);
    return exp2_split(n, t - n);
}

/* out [rows, n] = w · bf16(x / rms(x)), normalised in fp32 (as transformers' LlamaRMSNorm);
 * x rows `x_stride` elements apart. */
void rms_norm_bf16(const uint16_t *x, long x_stride, const uint16_t *w, int rows, int n,
                   float eps, int threads, uint16_t *out) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 8)
    for (int t = 0; t < rows; t++) {
        const uint16_t *xr = x + (size_t)t * x_stride;
        uint16_t *o = out + (size_t)t * n;
        float ss = 0.f;
        for (int i = 0; i < n; i++) {
            float v = bf16_to_f32(xr[i]);
            ss += v * v;
        }
        float r = 1.f / sqrtf(ss / (float)n + eps);
        for (int i = 0; i < n; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(xr[i]) * r));
    }
}

/* gu [rows, 2n] (gate | up) -> out [rows, n] = bf16(silu(gate)) · up. */
void silu_mul_bf16(const uint16_t *gu, int rows, int n, int threads, uint16_t *out) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 8)
    for (int t = 0; t < rows; t++) {
        const uint16_t *g = gu + (size_t)t * 2 * n, *u = g + n;
        uint16_t *o = out + (size_t)t * n;
        for (int i = 0; i < n; i++) {
            float x = bf16_to_f32(g[i]);
            o[i] = f32_to_bf16(round_bf16(x / (1.f + exp_ulp(-x))) * bf16_to_f32(u[i]));
        }
    }
}

/* Rotate-half RoPE: x rows `x_stride` elements apart, each `heads` heads of hd; cos, sin
 * [rows, hd/2] -> out [rows, heads, hd] = (x1·cos − x2·sin, x2·cos + x1·sin), each product and
 * each sum rounded to bf16 as torch's bf16 ops round them. */
void rope_bf16(const uint16_t *x, long x_stride, int rows, int heads, int hd,
               const uint16_t *cos_, const uint16_t *sin_, int threads, uint16_t *out) {
    int half = hd / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 8)
    for (int t = 0; t < rows; t++) {
        const uint16_t *c = cos_ + (size_t)t * half, *s = sin_ + (size_t)t * half;
        for (int h = 0; h < heads; h++) {
            const uint16_t *xr = x + (size_t)t * x_stride + (size_t)h * hd;
            uint16_t *o = out + ((size_t)t * heads + h) * hd;
            for (int i = 0; i < half; i++) {
                float x1 = bf16_to_f32(xr[i]), x2 = bf16_to_f32(xr[i + half]);
                float ci = bf16_to_f32(c[i]), si = bf16_to_f32(s[i]);
                o[i] = f32_to_bf16(round_bf16(x1 * ci) - round_bf16(x2 * si));
                o[i + half] = f32_to_bf16(round_bf16(x2 * ci) + round_bf16(x1 * si));
            }
        }
    }
}

/* ---- Greedy sampling ----------------------------------------------------------------------
 * out[r] = the index of the first maximum of row r of x [rows, n] (rows `stride` elements apart,
 * bf16 or fp32), or of its first NaN if it has one: torch's max(-1).indices, which on a CPU ran
 * one element at a time: [64, 49,152] bf16 logits took 0.99 ms on a 2-core Zen 5, this 0.10, and
 * whole decode steps of SmolLM2 0.96x the time at 64 rows, 0.98x at 32. One pass takes the row's
 * max 16 lanes at a time and notes NaNs; a second finds its first index. Returns 0, or -1
 * without AVX-512 (the caller keeps torch's op). */
#ifdef __AVX512F__
/* Elements i .. i+15 of a row (those below n; the rest 0) as fp32. */
static inline __m512 load16(const uint16_t *xb, const float *xf, int bf16, int i, __mmask16 m) {
    return bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(
                      _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, xb + i)), 16))
                : _mm512_maskz_loadu_ps(m, xf + i);
}
#endif

int argmax_rows(const void *x, long stride, int rows, int n, int bf16, int threads, int64_t *out) {
#ifdef __AVX512F__
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 4)
    for (int r = 0; r < rows; r++) {
        const uint16_t *xb = (const uint16_t *)x + (size_t)r * stride;
        const float *xf = (const float *)x + (size_t)r * stride;
        __m512 mx = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (int i = 0; i < n; i += 16) {
            __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            __m512 v = load16(xb, xf, bf16, i, m);
            nan |= _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
            mx = _mm512_mask_max_ps(mx, m, mx, v);
        }
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        int64_t at = 0;
        for (int i = 0; i < n; i += 16) { /* the first NaN, else the first element equal to top */
            __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
            __m512 v = load16(xb, xf, bf16, i, m);
            __mmask16 hit = nan ? _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q)
                                : _mm512_mask_cmp_ps_mask(m, v, top, _CMP_EQ_OQ);
            if (hit) { at = i + __builtin_ctz(hit); break; }
        }
        out[r] = at;
    }
    return 0;
#else
    (void)x; (void)stride; (void)rows; (void)n; (void)bf16; (void)threads; (void)out;
    return -1;
#endif
}

/* ---- The layers' GEMMs in bf16, on AVX512-BF16 --------------------------------------------
 * out [m, n] = x [m, k] · Wᵀ (+ bias), bf16 in and out, each output one fp32 sum of vdpbf16ps
 * pair products over k in order, then the bias, rounded once: a row's outputs do not depend on
 * how many rows run with it (oneDNN's one-row kernel sums in another order than its many-row
 * ones). W is packed once (gemm_bf16_pack) as [n/32][k/2][32 columns][2]: a column block's
 * k-pair is one 64-byte line for each of two zmm. A work item is 32 columns for every row,
 * eight rows at a time: each W line loaded serves 8 rows, 16 dpbf16 chains per line pair, and
 * the block's W (36 KB at k = 576) stays in L1/L2 across the row blocks. Threads take runs of
 * an eighth of the blocks (two threads) in turn: each run is one stream of W that the hardware
 * prefetcher follows (blocks taken one at a time left the lm_head's 57 MB 1.1-1.2x slower than
 * oneDNN's), and a core slowed by other load leaves the rest to the other. On a 2-core Zen 5,
 * SmolLM2's 30 layers' GEMMs with weights from DRAM took 0.68-0.87x oneDNN's packed GEMMs' time
 * at 2-64 rows, the lm_head 0.87-1.08x, and whole decode steps 0.77-0.94x; prefill steps the same
 * time (0.98-1.01x). But a block's rows past the first 8 read its W from cache, and the hardware
 * prefetcher, which runs ahead of the misses, waits for the next block's first miss: from 8 rows
 * up, the W read and the sums took turns (8-64 rows cost about the 1-row time plus the compute).
 * So each group of 8 rows asks for its share of the next block's W as it goes (group g of G the
 * k-pairs g, g + G, …; one group's whole share at once, with the sums still to run, overran the
 * prefetch queue): the layers and lm_head took 0.83-0.86x the time at 24-64 rows, 0.87-0.97x at
 * 16, 0.92x at 8, 0.97x at 128, 0.98-1.01x at 256-1,024 (the same bits; 1-7 rows, all W read,
 * keep to the hardware's prefetcher; asking two blocks ahead was 1.05x slower). Where the CPU
 * has AMX the tiles below run it instead. */
#define GEMM_COLS 32
#define GEMM_ROWS 8

/* ---- The same GEMM on AMX tiles (where the compiler targets AMX-BF16 and the kernel lets this
 * process use the tile registers) -------------------------------------------------------------
 * oneDNN's AMX GEMMs pick their kernels and blockings by row count: a row's result changed with
 * the rows beside it (batches of 33-256 rows against 2, and rows 32-63 of 64 against the same 32
 * alone), so a request's greedy tokens depended on its step's batch. Here a tile product sums a
 * row's 32-k chunk the same way whatever the other rows, and the chunks are added in k order in
 * an fp32 tile: each output is one function of its row. The W layout is the one above: a 16-pair
 * x 16-column B tile is a half of 16 of its 128-byte k-pair lines (loaded with a stride). Rows go
 * 32 at a time (four C tiles, two A, two B: every W tile serves 32 rows; 16 where no more are
 * left), from a copy of x packed in tile order and zero-padded. Threads take runs of column
 * blocks as above. On a 2-core Xeon, SmolLM2's 30 layers at 2-32 rows took 0.76-0.87x the time
 * of oneDNN's AMX GEMMs, at 64 ~1.0x, at 256-1,024 1.04-1.10x (bench/cpu_gemm.py); whole decode
 * steps 0.72-0.96x, prefill steps 0.99-1.02x (the engine slices a step's rows by 1,024). */
#if HAVE_AMX
#define AMX_K 32 /* the k values of one A tile row: 16 pairs */

static void amx_configure_gemm(void) { /* every tile 16 rows of 64 bytes */
    static const uint8_t rows[8] = {16, 16, 16, 16, 16, 16, 16, 16};
    static const uint16_t colsb[8] = {64, 64, 64, 64, 64, 64, 64, 64};
    amx_configure(rows, colsb);
}

/* c [32][32] fp32 = a packed 32-row block of x · one packed column block. A k chunk's two A
 * tiles and two B tiles are 2 KB each, contiguous, the chunks one after another: two streams the
 * hardware prefetcher follows. */
static void amx_rows32(const uint16_t *a, const uint16_t *wb, int chunks, float *c) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int ch = 0; ch < chunks; ch++) {
        const uint16_t *w = wb + (size_t)ch * (AMX_K / 2) * GEMM_COLS * 2;
        const uint16_t *x = a + (size_t)ch * 32 * AMX_K;
        _tile_loadd(4, x, AMX_K * 2);
        _tile_loadd(5, x + 16 * AMX_K, AMX_K * 2);
        _tile_loadd(6, w, GEMM_COLS * 4);
        _tile_loadd(7, w + 32, GEMM_COLS * 4);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, GEMM_COLS * 4); _tile_stored(1, c + 16, GEMM_COLS * 4);
    _tile_stored(2, c + 16 * GEMM_COLS, GEMM_COLS * 4);
    _tile_stored(3, c + 16 * GEMM_COLS + 16, GEMM_COLS * 4);
}

/* The same for the block's first 16 rows (the rest are padding): c [16][32]. */
static void amx_rows16(const uint16_t *a, const uint16_t *wb, int chunks, float *c) {
    _tile_zero(0); _tile_zero(1);
    for (int ch = 0; ch < chunks; ch++) {
        const uint16_t *w = wb + (size_t)ch * (AMX_K / 2) * GEMM_COLS * 2;
        _tile_loadd(4, a + (size_t)ch * 32 * AMX_K, AMX_K * 2);
        _tile_loadd(6, w, GEMM_COLS * 4);
        _tile_loadd(7, w + 32, GEMM_COLS * 4);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
    }
    _tile_stored(0, c, GEMM_COLS * 4); _tile_stored(1, c + 16, GEMM_COLS * 4);
}

static void amx_rows(const uint16_t *a, int rows, const uint16_t *wb, int chunks, float *c) {
    if (rows > 16) amx_rows32(a, wb, chunks, c);
    else amx_rows16(a, wb, chunks, c);
}

/* A block's sums c [rows][32] + bias (b0, b1), rounded into o (rows `width` apart). */
static void round_block(const float *c, int rows, __m512 b0, __m512 b1, uint16_t *o, int width) {
    for (int r = 0; r < rows; r++, o += width) {
        __m512 s0 = _mm512_add_ps(_mm512_load_ps(c + r * GEMM_COLS), b0);
        __m512 s1 = _mm512_add_ps(_mm512_load_ps(c + r * GEMM_COLS + 16), b1);
        _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(s0));
        _mm256_storeu_si256((__m256i *)(o + 16), (__m256i)_mm512_cvtneps_pbh(s1));
    }
}

/* silu(gate) · up of a block's gate and up sums (each [rows][32]) into o, each rounded where
 * gemm_bf16's output and silu_mul_bf16 round them. */
static void round_silu_block(const float *gate, const float *up, int rows, uint16_t *o, int width) {
    for (int r = 0; r < rows; r++, o += width)
        for (int i = 0; i < GEMM_COLS; i++) {
            float g = round_bf16(gate[r * GEMM_COLS + i]);
            float u = round_bf16(up[r * GEMM_COLS + i]);
            o[i] = f32_to_bf16(round_bf16(g / (1.f + exp_ulp(-g))) * u);
        }
}

/* silu: W is [gate; up] and out [m, n/2] = silu(gate) · up, rounded as gemm_bf16's output and
 * silu_mul_bf16 round them (a work item is a gate block with its up block). */
static int gemm_amx(const uint16_t *x, long x_stride, int m, int k, const uint16_t *wp,
                    const uint16_t *bias, int n, int silu, int threads, uint16_t *out) {
    int chunks = k / AMX_K, pairs = k / 2, blocks = n / GEMM_COLS / (silu ? 2 : 1);
    int run = blocks / (4 * threads) + 1, width = silu ? n / 2 : n, row_blocks = (m + 31) / 32;
    /* x packed as [row block][k chunk][32 rows][32 k], rows past m zero */
    uint16_t *ap = aligned_alloc(64, (size_t)row_blocks * 32 * k * sizeof(uint16_t));
    if (!ap) return -1;
    /* A thread's run of column blocks goes over the rows a group at a time: the group's x (up
     * to 256 KB) stays in L2 across the run, a block's W (36 KB at k = 576) in L1/L2 across it */
    int group = (int)((256 << 10) / ((size_t)k * sizeof(uint16_t))) / 32;
    group = group < 1 ? 1 : group;
    int runs = (blocks + run - 1) / run;
#pragma omp parallel num_threads(threads)
    {
        float c[32 * GEMM_COLS] __attribute__((aligned(64)));
        float cu[32 * GEMM_COLS] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int rb = 0; rb < row_blocks; rb++)
            for (int r = 0; r < 32; r++)
                for (int ch = 0; ch < chunks; ch++) {
                    uint16_t *dst = ap + (((size_t)rb * chunks + ch) * 32 + r) * AMX_K;
                    if (rb * 32 + r < m)
                        memcpy(dst, x + (size_t)(rb * 32 + r) * x_stride + ch * AMX_K, AMX_K * 2);
                    else
                        memset(dst, 0, AMX_K * 2);
                }
        amx_configure_gemm();
#pragma omp for schedule(dynamic, 1)
        for (int ri = 0; ri < runs; ri++)
            for (int g0 = 0; g0 < row_blocks; g0 += group)
                for (int nb = ri * run; nb < blocks && nb < (ri + 1) * run; nb++) {
                    const uint16_t *wb = wp + (size_t)nb * pairs * GEMM_COLS * 2;
                    __m512 b0 = _mm512_setzero_ps(), b1 = b0;
                    if (bias) {
                        b0 = load16(bias + nb * GEMM_COLS, NULL, 1, 0, (__mmask16)0xffff);
                        b1 = load16(bias + nb * GEMM_COLS + 16, NULL, 1, 0, (__mmask16)0xffff);
                    }
                    for (int rb = g0; rb < row_blocks && rb < g0 + group; rb++) {
                        int rows = m - rb * 32 < 32 ? m - rb * 32 : 32;
                        const uint16_t *a = ap + (size_t)rb * chunks * 32 * AMX_K;
                        uint16_t *o = out + (size_t)rb * 32 * width + nb * GEMM_COLS;
                        amx_rows(a, rows, wb, chunks, c);
                        if (silu) {
                            const uint16_t *wu = wb + (size_t)blocks * pairs * GEMM_COLS * 2;
                            amx_rows(a, rows, wu, chunks, cu);
                            round_silu_block(c, cu, rows, o, width);
                        } else {
                            round_block(c, rows, b0, b1, o, width);
                        }
                    }
                }
        _tile_release();
    }
    free(ap);
    return 0;
}
#endif

/* Which GEMM gemm_bf16 runs: 2 AMX tiles, 1 AVX512-BF16, 0 none. */
int gemm_bf16_kind(void) {
#if HAVE_AMX
    if (amx_permitted()) return 2;
#endif
#ifdef __AVX512BF16__
    return 1;
#else
    return 0;
#endif
}

int gemm_bf16_supported(int n, int k) {
#ifdef __AVX512BF16__
    int kind = gemm_bf16_kind();
    return n > 0 && k > 0 && n % GEMM_COLS == 0 && k % (kind == 2 ? 32 : 2) == 0;
#else
    (void)n; (void)k;
    return 0;
#endif
}

/* w [n, k] (row-major, as torch's Linear weight) -> out [n/32][k/2][32][2]. */
void gemm_bf16_pack(const uint16_t *w, int n, int k, uint16_t *out) {
    int pairs = k / 2;
    for (int nb = 0; nb < n / GEMM_COLS; nb++)
        for (int p = 0; p < pairs; p++)
            for (int c = 0; c < GEMM_COLS; c++) {
                const uint16_t *src = w + (size_t)(nb * GEMM_COLS + c) * k + 2 * p;
                uint16_t *dst = out + (((size_t)nb * pairs + p) * GEMM_COLS + c) * 2;
                dst[0] = src[0];
                dst[1] = src[1];
            }
}

#ifdef __AVX512BF16__
/* Rows m0 .. m0+mr-1 (mr <= GEMM_ROWS, a constant where inlined) of one 32-column block; with
 * `next`, the W lines of k-pairs np, np + nstride, … of the block at `next` are asked for (into
 * L2) as the loop passes them. */
static inline __attribute__((always_inline)) void
gemm_block(const uint16_t *x, long x_stride, int m0, int mr, int pairs, const uint32_t *wb,
           const uint16_t *bias, int n, int col, uint16_t *out, const uint32_t *next, int np,
           int nstride) {
    __m512 a[GEMM_ROWS][2];
    const uint32_t *xr[GEMM_ROWS];
    for (int r = 0; r < mr; r++) {
        a[r][0] = a[r][1] = _mm512_setzero_ps();
        xr[r] = (const uint32_t *)(x + (size_t)(m0 + r) * x_stride);
    }
    for (int p = 0; p < pairs; p++) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + (size_t)p * GEMM_COLS);
        __m512bh w1 = (__m512bh)_mm512_loadu_si512(wb + (size_t)p * GEMM_COLS + 16);
        if (next && p == np) {
            __builtin_prefetch(next + (size_t)p * GEMM_COLS, 0, 2);
            __builtin_prefetch(next + (size_t)p * GEMM_COLS + 16, 0, 2);
            np += nstride;
        }
        for (int r = 0; r < mr; r++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xr[r][p]);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], xb, w0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], xb, w1);
        }
    }
    __m512 b0 = _mm512_setzero_ps(), b1 = b0;
    if (bias) {
        b0 = load16(bias + col, NULL, 1, 0, (__mmask16)0xffff);
        b1 = load16(bias + col + 16, NULL, 1, 0, (__mmask16)0xffff);
    }
    for (int r = 0; r < mr; r++) {
        uint16_t *o = out + (size_t)(m0 + r) * n + col;
        __m512 s0 = bias ? _mm512_add_ps(a[r][0], b0) : a[r][0];
        __m512 s1 = bias ? _mm512_add_ps(a[r][1], b1) : a[r][1];
        _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(s0));
        _mm256_storeu_si256((__m256i *)(o + 16), (__m256i)_mm512_cvtneps_pbh(s1));
    }
}
#endif

/* out [m, n] = x [m, k] (rows x_stride apart) · Wᵀ + bias (NULL: none), wp from gemm_bf16_pack.
 * Returns 0, or -1 where gemm_bf16_supported says no or memory runs out (AMX: x packed). */
int gemm_bf16(const uint16_t *x, long x_stride, int m, int k, const uint16_t *wp,
              const uint16_t *bias, int n, int threads, uint16_t *out) {
#ifdef __AVX512BF16__
    if (!gemm_bf16_supported(n, k)) return -1;
#if HAVE_AMX
    if (gemm_bf16_kind() == 2) {
        return gemm_amx(x, x_stride, m, k, wp, bias, n, 0, threads, out);
    }
#endif
    int pairs = k / 2, blocks = n / GEMM_COLS, run = blocks / (4 * threads) + 1;
#pragma omp parallel for num_threads(threads) schedule(dynamic, run)
    for (int nb = 0; nb < blocks; nb++) {
        const uint32_t *wb = (const uint32_t *)(wp + (size_t)nb * pairs * GEMM_COLS * 2);
        /* the next block's W, asked for a share per group of 8 rows (see the comment above) */
        const uint32_t *next =
            m >= GEMM_ROWS && nb + 1 < blocks ? wb + (size_t)pairs * GEMM_COLS : NULL;
        int m0 = 0;
        for (; m0 + GEMM_ROWS <= m; m0 += GEMM_ROWS)
            gemm_block(x, x_stride, m0, GEMM_ROWS, pairs, wb, bias, n, nb * GEMM_COLS, out, next,
                       m0 / GEMM_ROWS, m / GEMM_ROWS);
        switch (m - m0) { /* the last rows, each count a constant for the compiler */
#define TAIL(R) \
    case R: gemm_block(x, x_stride, m0, R, pairs, wb, bias, n, nb * GEMM_COLS, out, NULL, 0, 0); \
        break;
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7)
#undef TAIL
        default: break;
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)m; (void)k; (void)wp; (void)bias; (void)n; (void)threads;
    (void)out;
    return -1;
#endif
}

/* out [m, n/2] = silu(x · Wgᵀ) · (x · Wuᵀ), W = [gate; up] [n, k] packed by gemm_bf16_pack: to the
 * bit gemm_bf16 (no bias) then silu_mul_bf16, in one pass that never writes the [m, n] sums (on
 * AMX only). Returns 0, or -1 where it does not run (no AMX, n/2 not a multiple of 32) or memory
 * runs out. */
int gemm_bf16_silu(const uint16_t *x, long x_stride, int m, int k, const uint16_t *wp, int n,
                   int threads, uint16_t *out) {
#if HAVE_AMX
    if (gemm_bf16_kind() == 2 && gemm_bf16_supported(n, k) && n % (2 * GEMM_COLS) == 0)
        return gemm_amx(x, x_stride, m, k, wp, NULL, n, 1, threads, out);
#endif
    (void)x; (void)x_stride; (void)m; (void)k; (void)wp; (void)n; (void)threads; (void)out;
    return -1;
}
