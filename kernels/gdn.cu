// Gated DeltaNet pieces of the linear-attention layers (model-spec.md 2.4), for batches of
// sequences laid out back to back: sequence s owns tokens [cu[s], cu[s+1]) and the state slot
// slot[s]. Multi-token sequences are processed token by token (the exact recurrence; the
// chunked form is a prefill optimisation with the same result up to rounding).
//
// ninfer_gdn_conv  (step 2: causal depthwise conv, kernel 4, no bias, then SiLU)
//   x: bf16 [T, ldx], channel c of token t at x[t*ldx + c], C channels (the in_proj_qkv output);
//   w: bf16 [C, 4] (index 3 multiplies the current token);
//   state: bf16 [slots, 3, C]: row 0 = input three tokens back, row 2 = the previous token's
//   input; zero at sequence start. Updated to the last three inputs of the sequence.
//   y[t*ldy + c] = bf16(silu(bf16(sum_i w[c,i] * in[t-3+i][c])))   (bf16 conv, bf16 SiLU).
//   y must not alias x. Launch: block 128, grid (ceil(C / 128), seqs); one thread per channel.
//
// ninfer_gdn_recurrent  (steps 3-7)
//   qkv: bf16 [T, ld_qkv], the conv output: q head i at channels [i*dk, (i+1)*dk), k head i at
//   Hk*dk + i*dk, v head h at 2*Hk*dk + h*dv. Value head h reads q/k head h / (Hv / Hk).
//   b, a: bf16 [T, ld_ba] raw logits (column h per value head); A_log, dt_bias: f32 [Hv].
//   beta = bf16(sigmoid(b)); g = -exp(A_log) * softplus(a + dt_bias) (f32); decay = exp(g).
//   q^ = q / sqrt(sum q^2 + 1e-6) / sqrt(dk); k^ = k / sqrt(sum k^2 + 1e-6)   (f32)
//   State S: f32 [slots, Hv, dk, dv] ([key dim, value dim] per head), zero at sequence start:
//     S <- decay * S;  u = S^T k^;  delta = beta * (v - u);  S <- S + k^ delta^T;  o = S^T q^
//   out: bf16 [T, Hv, dv] dense, o rounded once.
//   Limits: dk % 8 == 0, dk <= 128, Hv % Hk == 0.
//   Launch: block 256 = 32 value columns x 8 key slices, grid (ceil(dv / 32), Hv, seqs).
#include "conv.cuh"

struct ConvArgs {
    const bf16* x;
    const bf16* w;
    bf16* state;
    bf16* y;
    const int* cu;
    const int* slot;
    int seqs;
    int channels;
    int ldx;
    int ldy;
};
static_assert(sizeof(ConvArgs) == 64, "mirrored in crates/ninfer-kernels/src/gdn.rs");

extern "C" __global__ void __launch_bounds__(128) ninfer_gdn_conv(ConvArgs a) {
    grid_release();
    grid_wait();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int s = blockIdx.y;
    if (c >= a.channels) return;
    const int t0 = a.cu[s], t1 = a.cu[s + 1];
    bf16* st = a.state + (size_t)a.slot[s] * 3 * a.channels + c;
    float h0 = bf2f(st[0]), h1 = bf2f(st[a.channels]), h2 = bf2f(st[2 * (size_t)a.channels]);
    const uint2 wr = __ldg(reinterpret_cast<const uint2*>(a.w + (size_t)c * 4));
    for (int t = t0; t < t1; ++t) {
        const float xt = bf2f(a.x[(size_t)t * a.ldx + c]);
        a.y[(size_t)t * a.ldy + c] = conv4_silu(wr, h0, h1, h2, xt);
        h0 = h1;
        h1 = h2;
        h2 = xt;
    }
    if (t1 > t0) {
        st[0] = f2bf(h0);
        st[a.channels] = f2bf(h1);
        st[2 * (size_t)a.channels] = f2bf(h2);
    }
}

struct RecArgs {
    const bf16* qkv;
    const bf16* b;
    const bf16* a;
    const float* a_log;
    const float* dt_bias;
    float* state;
    bf16* out;
    const int* cu;
    const int* slot;
    int seqs;
    int hk;
    int hv;
    int dk;
    int dv;
    int ld_qkv;
    int ld_ba;
    int pad;
};
static_assert(sizeof(RecArgs) == 104, "mirrored in crates/ninfer-kernels/src/gdn.rs");

#define GDN_SLICES 8
#define GDN_MAX_DK 128
#define GDN_KPT (GDN_MAX_DK / GDN_SLICES)

__device__ __forceinline__ float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

extern "C" __global__ void __launch_bounds__(256) ninfer_gdn_recurrent(RecArgs a) {
    grid_release();
    grid_wait();
    __shared__ float qs[GDN_MAX_DK];
    __shared__ float ks[GDN_MAX_DK];
    __shared__ float red[2][GDN_SLICES][32];
    __shared__ float scal[4];
    const int lane = threadIdx.x & 31;   // value column within the group
    const int slice = threadIdx.x >> 5;  // key slice
    const int h = blockIdx.y;
    const int s = blockIdx.z;
    const int j = blockIdx.x * 32 + lane;
    const bool col_ok = j < a.dv;
    const int kh = h / (a.hv / a.hk);
    const int kpt = a.dk / GDN_SLICES;
    const int k0 = slice * kpt;
    const int t0 = a.cu[s], t1 = a.cu[s + 1];
    float* st = a.state + ((size_t)a.slot[s] * a.hv + h) * a.dk * a.dv;
    float S[GDN_KPT];
#pragma unroll
    for (int i = 0; i < GDN_KPT; ++i)
        S[i] = (i < kpt && col_ok) ? st[(size_t)(k0 + i) * a.dv + j] : 0.f;
    const float neg_a = -expf(a.a_log[h]);
    const float dtb = a.dt_bias[h];
    const float qscale = rsqrtf((float)a.dk);
    for (int t = t0; t < t1; ++t) {
        const bf16* row = a.qkv + (size_t)t * a.ld_qkv;
        // q and k of this head into shared memory, with their squared norms.
        const int tid = threadIdx.x;
        float vq = 0.f, vk = 0.f;
        if (tid < a.dk) {
            vq = bf2f(row[kh * a.dk + tid]);
            qs[tid] = vq;
        } else if (tid < 2 * a.dk) {
            vk = bf2f(row[a.hk * a.dk + kh * a.dk + tid - a.dk]);
            ks[tid - a.dk] = vk;
        }
        const float pq = warp_sum1(vq * vq), pk = warp_sum1(vk * vk);
        if (lane == 0) {
            red[0][slice][0] = pq;
            red[1][slice][0] = pk;
        }
        if (tid == 0) {
            scal[0] = round_bf(sigmoid(bf2f(a.b[(size_t)t * a.ld_ba + h])));
            scal[1] = expf(neg_a * softplus(bf2f(a.a[(size_t)t * a.ld_ba + h]) + dtb));
        }
        __syncthreads();
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (int w = 0; w < GDN_SLICES; ++w) {
            sq += red[0][w][0];
            sk += red[1][w][0];
        }
        const float rq = rsqrtf(sq + 1e-6f) * qscale;
        const float rk = rsqrtf(sk + 1e-6f);
        const float beta = scal[0], decay = scal[1];
        const float v = col_ok ? bf2f(row[2 * a.hk * a.dk + h * a.dv + j]) : 0.f;
        float u = 0.f;
#pragma unroll
        for (int i = 0; i < GDN_KPT; ++i) {
            if (i < kpt) {
                S[i] *= decay;
                u += S[i] * ks[k0 + i];
            }
        }
        __syncthreads();  // everyone has read the norm partials
        red[0][slice][lane] = u * rk;
        __syncthreads();
        float ut = 0.f;
#pragma unroll
        for (int w = 0; w < GDN_SLICES; ++w) ut += red[0][w][lane];
        const float delta = beta * (v - ut);
        float o = 0.f;
#pragma unroll
        for (int i = 0; i < GDN_KPT; ++i) {
            if (i < kpt) {
                S[i] += ks[k0 + i] * rk * delta;
                o += S[i] * qs[k0 + i];
            }
        }
        red[1][slice][lane] = o * rq;
        __syncthreads();
        if (slice == 0 && col_ok) {
            float ot = 0.f;
#pragma unroll
            for (int w = 0; w < GDN_SLICES; ++w) ot += red[1][w][lane];
            a.out[((size_t)t * a.hv + h) * a.dv + j] = f2bf(ot);
        }
        __syncthreads();  // shared q/k/partials are rewritten by the next token
    }
    if (col_ok) {
#pragma unroll
        for (int i = 0; i < GDN_KPT; ++i)
            if (i < kpt) st[(size_t)(k0 + i) * a.dv + j] = S[i];
    }
}
