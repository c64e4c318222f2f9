// Embedding lookup (model-spec.md 2.2: h0 = Embed[token]).
//
// ninfer_embed_bf16:  out[t, :] = table[ids[t], :]                        (bf16 [V, H] table)
// ninfer_embed_q8_g32: out[t, k] = bf16(q[ids[t], k] * scales[ids[t], k / 32])
//   (q8_g32 of format.md 3: i8 [V, H] and f16 [V, H/32]; the product is rounded once.)
// ids: i32 [tokens]; out: bf16 [tokens, ldo]. An id outside [0, V) yields a zero row rather
// than a read outside the table. H % 8 == 0 (bf16) or H % 32 == 0 (q8), rows 16-byte aligned.
// Launch: block 128, grid (tokens); each thread copies 8 elements at a time.
#include "common.cuh"

struct EmbedArgs {
    const void* p0;  // bf16 table, or q8 codes
    const void* p1;  // q8 scales (f16)
    const int* ids;
    bf16* out;
    int tokens;
    int vocab;
    int dim;
    int ldo;
};
static_assert(sizeof(EmbedArgs) == 48, "mirrored in crates/ninfer-kernels/src/embed.rs");

extern "C" __global__ void __launch_bounds__(128) ninfer_embed_bf16(EmbedArgs a) {
    grid_release();
    grid_wait();
    const int t = blockIdx.x;
    const int id = a.ids[t];
    const bool ok = id >= 0 && id < a.vocab;
    const bf16* src = static_cast<const bf16*>(a.p0) + (size_t)(ok ? id : 0) * a.dim;
    bf16* dst = a.out + (size_t)t * a.ldo;
    for (int c = threadIdx.x; c < a.dim / 8; c += blockDim.x) {
        const uint4 v = ok ? ldg16(src + c * 8) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(dst + c * 8) = v;
    }
}

extern "C" __global__ void __launch_bounds__(128) ninfer_embed_q8_g32(EmbedArgs a) {
    grid_release();
    grid_wait();
    const int t = blockIdx.x;
    const int id = a.ids[t];
    const bool ok = id >= 0 && id < a.vocab;
    const size_t r = (size_t)(ok ? id : 0);
    const int8_t* q = static_cast<const int8_t*>(a.p0) + r * a.dim;
    const __half* s = static_cast<const __half*>(a.p1) + r * (a.dim / 32);
    bf16* dst = a.out + (size_t)t * a.ldo;
    for (int c = threadIdx.x; c < a.dim / 8; c += blockDim.x) {
        float v[8];
        const uint2 raw = __ldg(reinterpret_cast<const uint2*>(q + c * 8));
        const float sc = ok ? __half2float(s[c / 4]) : 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t word = i < 4 ? raw.x : raw.y;
            const int8_t b = (int8_t)((word >> (8 * (i & 3))) & 0xff);
            v[i] = (float)b * sc;
        }
        *reinterpret_cast<uint4*>(dst + c * 8) = pack_bf8(v);
    }
}
