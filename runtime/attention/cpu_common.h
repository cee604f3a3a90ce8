/* Helpers shared by the CPU kernels (paged_decode.c, cpu_ops.c): bf16 conversions and a
 * vectorisable exp. */
#ifndef BLENDSERVE_CPU_COMMON_H
#define BLENDSERVE_CPU_COMMON_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v = { (uint32_t)x << 16 };
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even */
    union { float f; uint32_t u; } v = { f };
    return (uint16_t)((v.u + 0x7fff + ((v.u >> 16) & 1)) >> 16);
}

/* 2^(n + f) for an integer n and |f| < 1: 2^f by its Taylor polynomial of degree 6 (relative
 * error < 1e-5 on [0, 1), ~1e-7 on [-1/2, 1/2]); plain arithmetic, so that loops over it
 * vectorise (libm's expf does not). */
static inline float exp2_split(float n, float f) {
    float p = 1.5403530e-4f;
    p = p * f + 1.3333558e-3f;
    p = p * f + 9.6181291e-3f;
    p = p * f + 5.5504109e-2f;
    p = p * f + 2.4022651e-1f;
    p = p * f + 6.9314718e-1f;
    p = p * f + 1.f;
    union { int32_t i; float f; } two_n = { ((int32_t)n + 127) << 23 };
    return p * two_n.f;
}

/* AMX tiles (where the compiler targets AMX-BF16 and AVX512-BF16): whether Linux lets this
 * process use the tile data (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, asked once),
 * and a palette-1 tile configuration (tile t: rows[t] rows of colsb[t] bytes) for this thread. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

static inline int amx_permitted(void) {
    static int permitted = -1;
    if (permitted < 0) permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
}

static inline void amx_configure(const uint8_t rows[8], const uint16_t colsb[8]) {
    struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; }
    cfg = {0};
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = colsb[t];
        cfg.rows[t] = rows[t];
    }
    _tile_loadconfig(&cfg);
}
#else
#define HAVE_AMX 0
#endif

#endif
