/* The vector instructions the kernels are written in: the AVX2 / FMA / F16C intrinsics where the
 * build targets them (x86-64-v3), else their plain-C definitions (vec_portable.h) for the portable
 * build. NS_KEEP_IN_REGISTER is a register-allocation hint for the x86 build only; NS_FMA is the
 * scalar multiply-add that matches the build's vector one. */
#ifndef NANOSERVE_SIMD_H
#define NANOSERVE_SIMD_H

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define NS_KEEP_IN_REGISTER(v) __asm__("" : "+x"(v))
#define NS_FMA(a, b, c) fmaf(a, b, c)
#else
#include "vec_portable.h"
#define NS_KEEP_IN_REGISTER(v) ((void)0)
#endif

#endif
