// Gated DeltaNet pieces of the linear-attention layers (model-spec.md 2.4), for batches of
// sequences laid out back to back: sequence s owns tokens [cu[s], cu[s+1]) and the state slot
// slot[s]. ninfer_gdn_recurrent walks a sequence's tokens one by one (decode);
// ninfer_gdn_chunked computes the same recurrence 32 tokens at a time (prompts).
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
//
// ninfer_gdn_chunked  (steps 3-7, the same arguments, contract and limits; see its comment)
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

// Where a block of 256 threads (32 value columns x 8 key slices) stands in the recurrence of
// head h of sequence s; thread (slice, lane) holds state rows k0 .. k0 + kpt of column j.
struct Walker {
    int lane, slice, h, kh, j, kpt, k0;
    bool col_ok;
    float neg_a, dtb, qscale;
};

__device__ __forceinline__ Walker walker(const RecArgs& a, int j0) {
    Walker w;
    w.lane = threadIdx.x & 31;
    w.slice = threadIdx.x >> 5;
    w.h = blockIdx.y;
    w.kh = w.h / (a.hv / a.hk);
    w.j = j0 + w.lane;
    w.col_ok = w.j < a.dv;
    w.kpt = a.dk / GDN_SLICES;
    w.k0 = w.slice * w.kpt;
    w.neg_a = -expf(a.a_log[w.h]);
    w.dtb = a.dt_bias[w.h];
    w.qscale = rsqrtf((float)a.dk);
    return w;
}

// Token t of the recurrence on the state rows S of this thread, output row t written. Both
// kernels walk tokens through this one function, so a token walked by either gives the same
// bits.
__device__ __forceinline__ void walk_token(const RecArgs& a, const Walker& w, int t, float (&S)[GDN_KPT]) {
    __shared__ float qs[GDN_MAX_DK];
    __shared__ float ks[GDN_MAX_DK];
    __shared__ float red[2][GDN_SLICES][32];
    __shared__ float scal[4];
    const bf16* row = a.qkv + (size_t)t * a.ld_qkv;
    // q and k of this head into shared memory, with their squared norms.
    const int tid = threadIdx.x;
    float vq = 0.f, vk = 0.f;
    if (tid < a.dk) {
        vq = bf2f(row[w.kh * a.dk + tid]);
        qs[tid] = vq;
    } else if (tid < 2 * a.dk) {
        vk = bf2f(row[a.hk * a.dk + w.kh * a.dk + tid - a.dk]);
        ks[tid - a.dk] = vk;
    }
    const float pq = warp_sum1(vq * vq), pk = warp_sum1(vk * vk);
    if (w.lane == 0) {
        red[0][w.slice][0] = pq;
        red[1][w.slice][0] = pk;
    }
    if (tid == 0) {
        scal[0] = round_bf(sigmoid(bf2f(a.b[(size_t)t * a.ld_ba + w.h])));
        scal[1] = expf(w.neg_a * softplus(bf2f(a.a[(size_t)t * a.ld_ba + w.h]) + w.dtb));
    }
    __syncthreads();
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int i = 0; i < GDN_SLICES; ++i) {
        sq += red[0][i][0];
        sk += red[1][i][0];
    }
    const float rq = rsqrtf(sq + 1e-6f) * w.qscale;
    const float rk = rsqrtf(sk + 1e-6f);
    const float beta = scal[0], decay = scal[1];
    const float v = w.col_ok ? bf2f(row[2 * a.hk * a.dk + w.h * a.dv + w.j]) : 0.f;
    float u = 0.f;
#pragma unroll
    for (int i = 0; i < GDN_KPT; ++i) {
        if (i < w.kpt) {
            S[i] *= decay;
            u += S[i] * ks[w.k0 + i];
        }
    }
    __syncthreads();  // everyone has read the norm partials
    red[0][w.slice][w.lane] = u * rk;
    __syncthreads();
    float ut = 0.f;
#pragma unroll
    for (int i = 0; i < GDN_SLICES; ++i) ut += red[0][i][w.lane];
    const float delta = beta * (v - ut);
    float o = 0.f;
#pragma unroll
    for (int i = 0; i < GDN_KPT; ++i) {
        if (i < w.kpt) {
            S[i] += ks[w.k0 + i] * rk * delta;
            o += S[i] * qs[w.k0 + i];
        }
    }
    red[1][w.slice][w.lane] = o * rq;
    __syncthreads();
    if (w.slice == 0 && w.col_ok) {
        float ot = 0.f;
#pragma unroll
        for (int i = 0; i < GDN_SLICES; ++i) ot += red[1][i][w.lane];
        a.out[((size_t)t * a.hv + w.h) * a.dv + w.j] = f2bf(ot);
    }
    __syncthreads();  // shared q/k/partials are rewritten by the next token
}

// The state is read before grid_wait() (common.cuh's exception): only this launch writes it
// within a pass, so its last writer is a finished pass, and the read overlaps the kernel ahead.
// Its cu and slot are the pass's tables (the rule itself allows those).
extern "C" __global__ void __launch_bounds__(256) ninfer_gdn_recurrent(RecArgs a) {
    grid_release();
    const Walker w = walker(a, blockIdx.x * 32);
    const int s = blockIdx.z;
    const int t0 = a.cu[s], t1 = a.cu[s + 1];
    float* st = a.state + ((size_t)a.slot[s] * a.hv + w.h) * a.dk * a.dv;
    float S[GDN_KPT];
#pragma unroll
    for (int i = 0; i < GDN_KPT; ++i)
        S[i] = (i < w.kpt && w.col_ok) ? st[(size_t)(w.k0 + i) * a.dv + w.j] : 0.f;
    grid_wait();
    for (int t = t0; t < t1; ++t) walk_token(a, w, t, S);
    if (w.col_ok) {
#pragma unroll
        for (int i = 0; i < GDN_KPT; ++i)
            if (i < w.kpt) st[(size_t)(w.k0 + i) * a.dv + w.j] = S[i];
    }
}

// Chunked form of the same recurrence (FLA's WY form, model-spec.md 2.4), for prompts: the
// tokens of a sequence are taken 32 at a time. With G_t the running sum of log-decays inside
// the chunk (G_t = sum_{s<=t} g_s) and S0 the state at the chunk's start, the deltas of the
// chunk solve one triangular system and the outputs and next state follow from products:
//   (I + A) D = R,  A[t][r] = beta_t exp(G_t - G_r) k^_t.k^_r  (r < t),
//                    R[t]    = beta_t (v_t - exp(G_t) S0^T k^_t)
//   o_t = exp(G_t) S0^T q^_t + sum_{r<=t} exp(G_t - G_r) (q^_t.k^_r) D[r]
//   S   = exp(G_31) S0 + sum_r exp(G_31 - G_r) k^_r D[r]^T
// Every exponent is <= 0, so nothing overflows however strong the decay. The result equals
// ninfer_gdn_recurrent's up to f32 rounding (products summed in another order, exp(G) from
// summed logs rather than multiplied decays); tokens past a sequence's end get beta = 0, g = 0.
// Chunks start at each sequence's first token of the launch, every 32 tokens. A chunk of fewer
// than 12 tokens (a sequence's tail, a decode row) is walked token by token through the code
// of ninfer_gdn_recurrent, with its bits: a sequence whose chunks are all short gets exactly
// what ninfer_gdn_recurrent gives. On an H200 a chunk costs about as much as 10-12 walked tokens
// (kernel bench: 8 tokens 15.9 us walked vs 19.8 us chunked, 16 tokens 29.6 vs 20.9 us).
// Launch: block 256, grid (ceil(dv / 32), Hv, seqs), dynamic shared memory
// gdn_chunk_smem(dk) floats x 4 bytes. Each block owns 32 value columns of one head, whose
// state it keeps in shared memory; the columns of the delta rule evolve independently.
#define GDN_CHUNK 32
#define GDN_CHUNK_MIN 12
#define GDN_LDS 36  // row stride of the state and delta tiles: float4 rows without conflicts

// Layout of the dynamic shared memory, in floats (dk % 8 == 0, so every tile is 16-byte aligned).
struct ChunkSmem {
    float* k;   // [32][dk + 4] normalised keys k^
    float* q;   // [32][dk + 4] normalised, scaled queries q^
    float* s;   // [dk][GDN_LDS] state columns of the block
    float* d;   // [32][GDN_LDS] R, then the deltas D
    float* a;   // [32][GDN_LDS] A (strictly lower)
    float* m;   // [32][33] exp(G_t - G_r) q^_t.k^_r (lower with diagonal)
    float* g;   // [32] G_t
    float* w;   // [32] exp(G_31 - G_t)
    float* beta;  // [32]
};

__device__ __forceinline__ ChunkSmem chunk_smem(float* base, int dk) {
    ChunkSmem c;
    c.k = base;
    c.q = c.k + GDN_CHUNK * (dk + 4);
    c.s = c.q + GDN_CHUNK * (dk + 4);
    c.d = c.s + dk * GDN_LDS;
    c.a = c.d + GDN_CHUNK * GDN_LDS;
    c.m = c.a + GDN_CHUNK * GDN_LDS;
    c.g = c.m + GDN_CHUNK * 33;
    c.w = c.g + GDN_CHUNK;
    c.beta = c.w + GDN_CHUNK;
    return c;
}

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float comp(const float4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

extern "C" __global__ void __launch_bounds__(256) ninfer_gdn_chunked(RecArgs a) {
    grid_release();
    grid_wait();
    extern __shared__ float4 smem_chunk[];
    const int dk = a.dk, ldk = dk + 4;
    const ChunkSmem sm = chunk_smem(reinterpret_cast<float*>(smem_chunk), dk);
    const int s = blockIdx.z, j0 = blockIdx.x * 32;
    const Walker wk = walker(a, j0);
    const int lane = wk.lane, warp = wk.slice, h = wk.h, kh = wk.kh;
    const int t0 = a.cu[s], t1 = a.cu[s + 1];
    float* gst = a.state + ((size_t)a.slot[s] * a.hv + h) * dk * a.dv;
    for (int i = threadIdx.x; i < dk * 32; i += blockDim.x) {
        const int k = i >> 5, c = i & 31;
        sm.s[k * GDN_LDS + c] = j0 + c < a.dv ? gst[(size_t)k * a.dv + j0 + c] : 0.f;
    }
    __syncthreads();  // a walked first chunk reads rows that other warps loaded
    const int t = lane;        // chunk row of this thread in the 32 x 32 products
    const int j4 = warp * 4;   // its 4 value columns (block-relative)
    for (int c0 = t0; c0 < t1; c0 += GDN_CHUNK) {
        const int n = min(GDN_CHUNK, t1 - c0);
        if (n < GDN_CHUNK_MIN) {  // a short chunk: token by token, as ninfer_gdn_recurrent
            float S[GDN_KPT];
#pragma unroll
            for (int i = 0; i < GDN_KPT; ++i) S[i] = i < wk.kpt ? sm.s[(wk.k0 + i) * GDN_LDS + lane] : 0.f;
            for (int tok = c0; tok < c0 + n; ++tok) walk_token(a, wk, tok, S);
#pragma unroll
            for (int i = 0; i < GDN_KPT; ++i)
                if (i < wk.kpt) sm.s[(wk.k0 + i) * GDN_LDS + lane] = S[i];
            __syncthreads();
            continue;
        }
        // 1. q^, k^ (f32) and the gates of the chunk's tokens; warp w takes rows w, w + 8, ...
        for (int r = warp; r < GDN_CHUNK; r += 8) {
            const bf16* row = a.qkv + (size_t)(c0 + r) * a.ld_qkv;
            float sq = 0.f, sk = 0.f;
            for (int i = lane; i < dk; i += 32) {
                const float q = r < n ? bf2f(row[kh * dk + i]) : 0.f;
                const float k = r < n ? bf2f(row[a.hk * dk + kh * dk + i]) : 0.f;
                sm.q[r * ldk + i] = q;
                sm.k[r * ldk + i] = k;
                sq += q * q;
                sk += k * k;
            }
            const float rq = rsqrtf(warp_sum1(sq) + 1e-6f) * wk.qscale;
            const float rk = rsqrtf(warp_sum1(sk) + 1e-6f);
            for (int i = lane; i < dk; i += 32) {
                sm.q[r * ldk + i] *= rq;
                sm.k[r * ldk + i] *= rk;
            }
            if (lane == 0) {
                const size_t gi = (size_t)(c0 + r) * a.ld_ba + h;
                sm.beta[r] = r < n ? round_bf(sigmoid(bf2f(a.b[gi]))) : 0.f;
                sm.g[r] = r < n ? wk.neg_a * softplus(bf2f(a.a[gi]) + wk.dtb) : 0.f;
            }
        }
        __syncthreads();
        if (warp == 0) {  // G_t: inclusive scan of the log-decays
            float g = sm.g[lane];
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float up = __shfl_up_sync(0xffffffffu, g, o);
                if (lane >= o) g += up;
            }
            sm.g[lane] = g;
            sm.w[lane] = expf(__shfl_sync(0xffffffffu, g, 31) - g);
        }
        __syncthreads();
        const float gt = sm.g[t], bt = sm.beta[t], et = expf(gt);
        // 2. A and M (rows t, columns 4 * warp ..), then R and exp(G_t) S0^T q^_t (rows t,
        //    this warp's 4 columns); all read the chunk-start state.
        {
            const int r0 = warp * 4;
            float kk[4] = {0.f, 0.f, 0.f, 0.f}, qk[4] = {0.f, 0.f, 0.f, 0.f};
            for (int i = 0; i < dk; i += 4) {
                const float4 kt = ld4(sm.k + t * ldk + i), qt = ld4(sm.q + t * ldk + i);
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    const float4 kr = ld4(sm.k + (r0 + r) * ldk + i);
                    kk[r] += kt.x * kr.x + kt.y * kr.y + kt.z * kr.z + kt.w * kr.w;
                    qk[r] += qt.x * kr.x + qt.y * kr.y + qt.z * kr.z + qt.w * kr.w;
                }
            }
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int rr = r0 + r;
                const float decay = rr <= t ? expf(gt - sm.g[rr]) : 0.f;
                sm.a[t * GDN_LDS + rr] = rr < t ? bt * decay * kk[r] : 0.f;
                sm.m[t * 33 + rr] = decay * qk[r];
            }
        }
        float o[4] = {0.f, 0.f, 0.f, 0.f};
        {
            float ks[4] = {0.f, 0.f, 0.f, 0.f};
            for (int i = 0; i < dk; i += 4) {
                const float4 kt = ld4(sm.k + t * ldk + i), qt = ld4(sm.q + t * ldk + i);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float4 sv = ld4(sm.s + (i + e) * GDN_LDS + j4);
                    const float ke = comp(kt, e), qe = comp(qt, e);
                    ks[0] += ke * sv.x;
                    ks[1] += ke * sv.y;
                    ks[2] += ke * sv.z;
                    ks[3] += ke * sv.w;
                    o[0] += qe * sv.x;
                    o[1] += qe * sv.y;
                    o[2] += qe * sv.z;
                    o[3] += qe * sv.w;
                }
            }
            const bf16* vrow = a.qkv + (size_t)(c0 + t) * a.ld_qkv + 2 * a.hk * dk + h * a.dv;
            float4 rv;
            float* rp = reinterpret_cast<float*>(&rv);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int j = j0 + j4 + c;
                const float v = t < n && j < a.dv ? bf2f(vrow[j]) : 0.f;
                rp[c] = bt * (v - et * ks[c]);
                o[c] *= et;
            }
            *reinterpret_cast<float4*>(sm.d + t * GDN_LDS + j4) = rv;
        }
        __syncthreads();
        // 3. D = (I + A)^-1 R by forward substitution: one warp, a value column per lane.
        if (warp == 0) {
            float dcol[GDN_CHUNK];
#pragma unroll
            for (int r = 0; r < GDN_CHUNK; ++r) {
                float acc[4] = {sm.d[r * GDN_LDS + lane], 0.f, 0.f, 0.f};
#pragma unroll
                for (int p = 0; p < (r & ~3); p += 4) {
                    const float4 ar = ld4(sm.a + r * GDN_LDS + p);
                    acc[0] -= ar.x * dcol[p];
                    acc[1] -= ar.y * dcol[p + 1];
                    acc[2] -= ar.z * dcol[p + 2];
                    acc[3] -= ar.w * dcol[p + 3];
                }
#pragma unroll
                for (int p = r & ~3; p < r; ++p) acc[0] -= sm.a[r * GDN_LDS + p] * dcol[p];
                dcol[r] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
                sm.d[r * GDN_LDS + lane] = dcol[r];
            }
        }
        __syncthreads();
        // 4. Outputs of rows t, columns j4..j4+3.
        for (int r = 0; r < GDN_CHUNK; ++r) {
            const float mr = sm.m[t * 33 + r];
            const float4 dr = ld4(sm.d + r * GDN_LDS + j4);
            o[0] += mr * dr.x;
            o[1] += mr * dr.y;
            o[2] += mr * dr.z;
            o[3] += mr * dr.w;
        }
        if (t < n) {
            bf16* orow = a.out + ((size_t)(c0 + t) * a.hv + h) * a.dv;
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (j0 + j4 + c < a.dv) orow[j0 + j4 + c] = f2bf(o[c]);
        }
        // 5. Next state: rows lane + 32 i, columns j4..j4+3.
        const float eg = expf(sm.g[GDN_CHUNK - 1]);
#pragma unroll
        for (int i = 0; i < GDN_MAX_DK / 32; ++i) {
            const int k = lane + 32 * i;
            if (k >= dk) break;
            float4 acc = ld4(sm.s + k * GDN_LDS + j4);
            acc.x *= eg;
            acc.y *= eg;
            acc.z *= eg;
            acc.w *= eg;
            for (int r = 0; r < GDN_CHUNK; ++r) {
                const float kw = sm.k[r * ldk + k] * sm.w[r];
                const float4 dr = ld4(sm.d + r * GDN_LDS + j4);
                acc.x += kw * dr.x;
                acc.y += kw * dr.y;
                acc.z += kw * dr.z;
                acc.w += kw * dr.w;
            }
            *reinterpret_cast<float4*>(sm.s + k * GDN_LDS + j4) = acc;
        }
        __syncthreads();  // the next chunk rewrites every tile
    }
    for (int i = threadIdx.x; i < dk * 32; i += blockDim.x) {
        const int k = i >> 5, c = i & 31;
        if (j0 + c < a.dv) gst[(size_t)k * a.dv + j0 + c] = sm.s[k * GDN_LDS + c];
    }
}
