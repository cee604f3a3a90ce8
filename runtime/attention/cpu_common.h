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

#endif
