// Per-head q/k norm and partial rotary embedding of the full-attention layers
// (model-spec.md 2.3 steps 3-4), in place on bf16 heads, optionally writing the layer's KV
// cache rows of the same tokens (one launch where a separate cache write was another).
//
// ninfer_qk_norm_rope
//   Heads: q head h of token t at q + t*q_ld + h*q_hs (q_heads of them), k head h at
//   k + t*k_ld + h*k_hs (k_heads), each `dim` contiguous bf16 (q_hs = 2*dim on the q_proj
//   output, whose per-head gate half is left alone).
//   1. Optional zero-centred RMSNorm over the head (q_norm / k_norm; null weight = skip):
//      x = bf16(x / sqrt(mean(x^2) + eps) * (1 + w)), f32 math.
//   2. Rotate-half RoPE on dims [0, rot): for j < rot/2, inv_freq_j = 1 / theta^(2j / rot) (f32),
//      angle = f32(pos[t]) * inv_freq_j, c = bf16(cos(angle)), s = bf16(sin(angle)) (transformers
//      rounds cos/sin to the model dtype), and with transformers' bf16 arithmetic
//        x'[j]         = bf16(bf16(x[j] * c)         - bf16(x[j + rot/2] * s))
//        x'[j + rot/2] = bf16(bf16(x[j + rot/2] * c) + bf16(x[j] * s))
//      dims [rot, dim) are unchanged. Positions are 1-D (text: all mRoPE axes equal).
//   3. With k_cache != null: caches bf16 [cache_rows, k_heads, dim], token t's row at slot[t]
//      (slot < 0 skips the token). k_cache[slot[t], h, :] = the final k head h (also written in
//      place as above), v_cache[slot[t], h, :] = v head h of token t at v + t*v_ld + h*v_hs
//      (k_heads of them, copied unchanged). With k_cache == null, v, v_cache and slot are unused.
//   Limits: dim % 8 == 0, dim <= 512, rot even and <= dim, head starts and caches 16-byte
//   aligned; no two q/k heads overlap (q and k may share rows: the stacked q/k/v projection
//   output); v heads may share those rows but overlap no q/k head (they are read while other
//   warps rewrite q and k); the caches alias nothing else.
//   Launch: block 128 = 4 warps, one head per warp; items per token q_heads + k_heads, plus
//   k_heads (the v heads) with caches; grid ceil(tokens * items / 4).
#include "common.cuh"

#define ROPE_MAX_DIM 512

struct RopeArgs {
    bf16* q;
    bf16* k;
    const bf16* q_norm;
    const bf16* k_norm;
    const int* pos;
    const bf16* v;
    bf16* k_cache;
    bf16* v_cache;
    const int* slot;
    int tokens;
    int q_heads;
    int k_heads;
    int q_ld;
    int q_hs;
    int k_ld;
    int k_hs;
    int v_ld;
    int v_hs;
    int dim;
    int rot;
    float theta;
    float eps;
    int pad;
};
static_assert(sizeof(RopeArgs) == 128, "mirrored in crates/ninfer-kernels/src/rope.rs");

extern "C" __global__ void __launch_bounds__(128) ninfer_qk_norm_rope(RopeArgs a) {
    grid_release();
    __shared__ float buf[4][ROPE_MAX_DIM];
    __shared__ float cos_s[4][ROPE_MAX_DIM / 2], sin_s[4][ROPE_MAX_DIM / 2];
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const bool to_cache = a.k_cache != nullptr;
    const int heads = a.q_heads + a.k_heads * (to_cache ? 2 : 1);
    const int item = blockIdx.x * 4 + warp;
    if (item >= a.tokens * heads) {
        grid_wait();
        return;
    }
    const int t = item / heads;
    const int h = item - t * heads;
    const bool is_q = h < a.q_heads;
    const int chunks = a.dim / 8;
    const int half = a.rot / 2;
    // Before the wait, what needs no activation: the norm weights of this lane's chunks, and
    // the cos and sin of each rotary frequency at the token's position, one frequency per lane
    // (each serves two dims), and the cache slot: positions and slots are pass tables the host
    // copied up before the pass's first launch (common.cuh).
    const bf16* w = is_q ? a.q_norm : a.k_norm;
    uint4 wv8[ROPE_MAX_DIM / 8 / 32];
#pragma unroll
    for (int i = 0; i < ROPE_MAX_DIM / 8 / 32; ++i) {
        const int c = lane + 32 * i;
        if (w != nullptr && c < chunks) wv8[i] = ldg16(w + c * 8);
    }
    const int slot = to_cache && !is_q ? __ldg(a.slot + t) : -1;
    const float p = (float)__ldg(a.pos + t);
    for (int j = lane; j < half; j += 32) {
        const float ang = p * (1.0f / powf(a.theta, (float)(2 * j) / (float)a.rot));
        cos_s[warp][j] = round_bf(cosf(ang));
        sin_s[warp][j] = round_bf(sinf(ang));
    }
    grid_wait();
    if (h >= a.q_heads + a.k_heads) {
        // A v head: nothing to compute, only its cache row.
        if (slot < 0) return;
        const int hv = h - a.q_heads - a.k_heads;
        const bf16* src = a.v + (size_t)t * a.v_ld + (size_t)hv * a.v_hs;
        bf16* dst = a.v_cache + ((size_t)slot * a.k_heads + hv) * a.dim;
        for (int c = lane; c < chunks; c += 32)
            *reinterpret_cast<uint4*>(dst + c * 8) = ldg16(src + c * 8);
        return;
    }
    bf16* x = is_q ? a.q + (size_t)t * a.q_ld + (size_t)h * a.q_hs
                   : a.k + (size_t)t * a.k_ld + (size_t)(h - a.q_heads) * a.k_hs;
    float* row = buf[warp];
    float ss = 0.f;
    for (int c = lane; c < chunks; c += 32) {
        float v[8];
        unpack_bf8(*reinterpret_cast<const uint4*>(x + c * 8), v);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            row[c * 8 + i] = v[i];
            ss += v[i] * v[i];
        }
    }
    ss = warp_sum1(ss);
    if (w != nullptr) {
        const float inv = rsqrtf(ss / (float)a.dim + a.eps);
#pragma unroll
        for (int k = 0; k < ROPE_MAX_DIM / 8 / 32; ++k) {
            const int c = lane + 32 * k;
            if (c < chunks) {
                float wv[8];
                unpack_bf8(wv8[k], wv);
#pragma unroll
                for (int i = 0; i < 8; ++i) row[c * 8 + i] = round_bf(row[c * 8 + i] * inv * (1.f + wv[i]));
            }
        }
    }
    __syncwarp();
    bf16* kc = slot >= 0 ? a.k_cache + ((size_t)slot * a.k_heads + (h - a.q_heads)) * a.dim : nullptr;
    for (int c = lane; c < chunks; c += 32) {
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int d = c * 8 + i;
            float out = row[d];
            if (d < a.rot) {
                const int j = d < half ? d : d - half;
                const float cs = cos_s[warp][j];
                const float sn = sin_s[warp][j];
                if (d < half) {
                    out = round_bf(round_bf(row[d] * cs) - round_bf(row[d + half] * sn));
                } else {
                    out = round_bf(round_bf(row[d] * cs) + round_bf(row[d - half] * sn));
                }
            }
            v[i] = out;
        }
        const uint4 packed = pack_bf8(v);
        *reinterpret_cast<uint4*>(x + c * 8) = packed;
        if (kc != nullptr) *reinterpret_cast<uint4*>(kc + c * 8) = packed;
    }
}
