// Shared device helpers for every kernel file: bf16/f16/fp8 conversions, the E2M1 expansion
// used by nvfp4 weights, warp reductions, 16-byte vector loads, mbarriers and bulk copies.
// Encodings follow docs/format.md section 3; nothing here launches work on its own.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;

#define NINFER_WARP 32

__device__ __forceinline__ float bf2f(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ bf16 f2bf(float v) { return __float2bfloat16_rn(v); }
// Round an f32 to the nearest bf16 and back: where the model rounds to its dtype
// (model-spec.md 2.7), the kernels do the same with this.
__device__ __forceinline__ float round_bf(float v) { return bf2f(f2bf(v)); }

// bf16 bits -> f32 is a 16-bit shift; w holds two bf16 values, low half first.
__device__ __forceinline__ float bf_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ float f16_bits_to_f(uint16_t h) {
    return __half2float(__ushort_as_half(h));
}

// Unpack eight bf16 values held in a 16-byte vector.
__device__ __forceinline__ void unpack_bf8(const uint4 v, float out[8]) {
    out[0] = bf_lo(v.x); out[1] = bf_hi(v.x);
    out[2] = bf_lo(v.y); out[3] = bf_hi(v.y);
    out[4] = bf_lo(v.z); out[5] = bf_hi(v.z);
    out[6] = bf_lo(v.w); out[7] = bf_hi(v.w);
}

__device__ __forceinline__ uint32_t pack_bf2(float lo, float hi) {
    const uint32_t l = __bfloat16_as_ushort(f2bf(lo));
    const uint32_t h = __bfloat16_as_ushort(f2bf(hi));
    return l | (h << 16);
}

__device__ __forceinline__ uint4 pack_bf8(const float v[8]) {
    uint4 r;
    r.x = pack_bf2(v[0], v[1]);
    r.y = pack_bf2(v[2], v[3]);
    r.z = pack_bf2(v[4], v[5]);
    r.w = pack_bf2(v[6], v[7]);
    return r;
}

// Read-only 16-byte load through the non-coherent cache (weights, activations of earlier launches).
__device__ __forceinline__ uint4 ldg16(const void* p) {
    return __ldg(reinterpret_cast<const uint4*>(p));
}

// Weight streams are read once per launch: ask the cache not to keep them.
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// Brings the 128-byte line holding p into L2 without waiting for it (weights a kernel is about
// to read, requested before it waits on the kernel ahead of it).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Asks L2 for `bytes` (a multiple of 16) from p (16-byte aligned) through the copy engine, one
// request, without waiting for it (PTX ISA "cp.async.bulk.prefetch", sm_90+).
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

__device__ __forceinline__ void prefetch_l1(const void* p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// Programmatic dependent launch (PTX ISA "griddepcontrol", sm_90+). Every kernel but the
// cooperative sampler is launched allowed to start while the kernel ahead of it in the stream
// is still running (launch.rs), so every kernel keeps this rule: nothing before `grid_wait()`
// reads memory an earlier kernel writes, or writes memory at all. Before it a kernel may only
// compute indices and read what no kernel writes: weights, and the pass's tables, which the
// host copies up before the pass's first launch. `grid_wait()` returns once the
// grids this one depends on have completed and their writes are visible; launched without the
// attribute it returns at once. `grid_release()` lets the next kernel start its own blocks
// (which then run up to their `grid_wait()`); every kernel calls it first thing, except the
// per-slot expert gate_up (experts.cu), which calls it after its wait so that down may read the
// routing before its own: down breaks the rule above on that guarantee. The other exception is
// state that one launch alone reads and writes in a pass (the GDN recurrent state, gdn.cu):
// its last writer is a launch of an earlier pass, and the engine synchronises with the host
// between passes (backend/cuda: every pass ends by copying its tokens or logits back), and
// clears a slot with a memset, which a dependent launch never overlaps, so it may be read
// before the wait.
__device__ __forceinline__ void grid_release() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Shared-memory mbarriers and bulk copies by the copy engine (PTX ISA "mbarrier" and
// cp.async.bulk, sm_90): a copy's bytes count against the barrier's current phase.
__device__ __forceinline__ uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
}

// This phase of `bar` completes once `bytes` have landed (and this one arrival is made).
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

// Returns once the phase of `bar` with this parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(smem_addr(bar)), "r"(parity)
            : "memory");
    }
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

// E4M3 (float8_e4m3fn) byte -> f32, exact; S.1111.111 decodes to NaN (format.md 3).
__device__ __forceinline__ float e4m3_to_f(uint8_t b) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(b), __NV_E4M3);
    return __half2float(__half(h));
}

// NVFP4 codes on the device. layout.cu's ninfer_nvfp4_device_layout rewrites every uploaded
// code word (format.md 3.5: 8 codes of 4 bits, code c in bits 4c..4c+3) so that the pair p of a
// word, codes 2p and 2p + 1, decodes in two instructions (pair 3: three): rotated left by
// nvfp4_rot(p), the word holds code 2p's magnitude bits (e1 e0 m) on bf16 exponent bits 8-7 and
// mantissa bit 6 of its low half and its sign on bit 15, code 2p + 1 the same in the high half,
// and every other bit of the mask below zero. Such a bf16 is E2M1 * 2^-126 exactly (code 001,
// 0.5, a subnormal). Pair 3 takes its two e1 bits from the word unrotated: no four rotations
// of the 8-bit pattern tile a 32-bit word, and this one pattern of five does (bits of code c, b:
// nvfp4_device_bit below). The layout is the device's alone: the artifact keeps format.md's.
#define NVFP4_PAIR_MASK 0x81c081c0u
__host__ __device__ constexpr int nvfp4_rot(int p) { return p == 0 ? 2 : p == 1 ? 6 : p == 2 ? 12 : 8; }

// Where bit b (0 m, 1 e0, 2 e1, 3 sign) of code c lands in the device word.
__host__ __device__ constexpr int nvfp4_device_bit(int c, int b) {
    const int target = (b < 3 ? 6 + b : 15) + 16 * (c & 1);
    const int rot = (c >> 1) == 3 && b == 2 ? 0 : nvfp4_rot(c >> 1);
    return (target - rot + 32) & 31;
}

// Pair p (a compile-time constant in every caller's unrolled loop) of a device word as bf16x2
// bits: low half code 2p, high half code 2p + 1, each E2M1 * 2^-126.
__device__ __forceinline__ uint32_t nvfp4_pair(uint32_t w, int p) {
    if (p == 3) return (__funnelshift_l(w, w, nvfp4_rot(3)) & 0x80c080c0u) | (w & 0x01000100u);
    return __funnelshift_l(w, w, nvfp4_rot(p)) & NVFP4_PAIR_MASK;
}

// An E4M3 scale byte times 2^118 as a bf16x2 pair (exact: 4 significant bits, 2^109..2^127):
// a decoded pair times it is E2M1 * scale * 2^-8.
__device__ __forceinline__ uint32_t nvfp4_scale_bf16x2(uint32_t byte) {
    const uint32_t b = __bfloat16_as_ushort(__float2bfloat16_rn(e4m3_to_f((uint8_t)byte) * 0x1p118f));
    return b | (b << 16);
}

template <int N>
__device__ __forceinline__ void warp_sum(float (&v)[N]) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
    }
}

__device__ __forceinline__ float warp_sum1(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max1(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Word i of a 16-byte vector.
__device__ __forceinline__ uint32_t u4_word(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
    const __nv_bfloat162 r = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const uint32_t*>(&r);
}

// d += A·B on the tensor cores: mma.m16n8k16, f32 accumulation, bf16 operands (mma_bf16) or
// f16 ones (mma_f16) (PTX ISA fragment layouts: lane = 4g + t holds A rows g, g+8 at k 2t, 2t+1
// (a0, a1) and 2t+8, 2t+9 (a2, a3); B column g at k 2t, 2t+1 (b0) and 2t+8, 2t+9 (b1); C rows g
// (c0, c1) and g+8 (c2, c3) at columns 2t, 2t+1).
#define NINFER_MMA_16816(name, type)                                                                   \
    __device__ __forceinline__ void name(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, \
                                         uint32_t b0, uint32_t b1) {                                      \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." type "." type                                \
                     ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                          \
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                      \
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                              \
    }
NINFER_MMA_16816(mma_bf16, "bf16")
NINFER_MMA_16816(mma_f16, "f16")

__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }
__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }
