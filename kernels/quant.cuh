// Weight encodings of docs/format.md section 3, decoded in registers for the matrix-vector
// kernels. Each encoding reads its row in "chunks": one 16-byte load of the main part per lane
// (8 bf16, 16 q8, or 32 packed 4/6-bit elements), plus the matching scale bytes. `dequant`
// yields the chunk's values without their scales and the GROUPS scales of the chunk's equal
// parts, so that dot products apply each scale once per group instead of once per element.
// `prefetch` asks L2 for a chunk's main part (its scales are small and read through L1).
// A matrix may be a bank of `experts` matrices of `rows` x `cols` stored back to back.
#pragma once
#include "common.cuh"

// One (possibly banked) encoded matrix as the kernels see it. Pointers are the encoding's parts
// in format.md order: bf16 {data}; q8_g32 {q, scales}; q6_g64 {ql, qh, scales};
// q4_g32 {q, scales}; nvfp4 {codes, scales, global}.
struct Mat {
    const void* p0;
    const void* p1;
    const void* p2;
    const float* global;  // nvfp4: [experts, segments] multipliers
    int experts;
    int rows;
    int cols;
    int segments;  // nvfp4: rows split into this many equal segments with their own global
};
static_assert(sizeof(Mat) == 48, "mirrored in crates/ninfer-kernels/src/gemv.rs");

// The arguments of every expert-bank kernel (experts.cu).
struct BankArgs {
    Mat bank;
    Mat shared;
    const bf16* x;
    const int* ids;
    const float* route_w;
    void* y;
    int tokens;
    int topk;
    int has_shared;
    int ldx;
    int ldy;
    int out_f32;
    int accumulate;
    int pad;
    const bf16* logits;  // with one token: the router's logits, routed by the kernels (experts.cu)
};
static_assert(sizeof(BankArgs) == 168, "mirrored in crates/ninfer-kernels/src/experts.rs");

// Magic-number conversion of a byte b (0..255) to float: 2^23 + b as f32 bits, minus 2^23.
// `bias` folds the encoding's zero point in: returns b - bias exactly.
__device__ __forceinline__ float byte_to_f(uint32_t word, int i, float magic_minus_bias) {
    const uint32_t sel = 0x7540u + (uint32_t)i;
    return __uint_as_float(__byte_perm(word, 0x4b000000u, sel)) - magic_minus_bias;
}
#define MAGIC_2P23 8388608.0f

struct EncBf16 {
    static constexpr int CHUNK = 8;
    static constexpr int GROUPS = 1;
    struct Raw { uint4 d; };
    __device__ static Raw load(const Mat& m, int e, int row, int c) {
        const size_t base = ((size_t)e * m.rows + row) * m.cols;
        return {ld_stream16(static_cast<const bf16*>(m.p0) + base + (size_t)c * CHUNK)};
    }
    __device__ static void prefetch(const Mat& m, int e, int row, int c) {
        prefetch_l2(static_cast<const bf16*>(m.p0) + ((size_t)e * m.rows + row) * m.cols + (size_t)c * CHUNK);
    }
    __device__ static void dequant(const Raw& r, float w[CHUNK], float sc[GROUPS]) {
        unpack_bf8(r.d, w);
        sc[0] = 1.f;
    }
};

struct EncQ8 {
    static constexpr int CHUNK = 16;
    static constexpr int GROUPS = 1;
    struct Raw { uint4 q; uint16_t s; };
    __device__ static Raw load(const Mat& m, int e, int row, int c) {
        const size_t r = (size_t)e * m.rows + row;
        Raw out;
        out.q = ld_stream16(static_cast<const int8_t*>(m.p0) + r * m.cols + (size_t)c * CHUNK);
        out.s = __ldg(static_cast<const uint16_t*>(m.p1) + r * (m.cols / 32) + c / 2);
        return out;
    }
    __device__ static void prefetch(const Mat& m, int e, int row, int c) {
        prefetch_l2(static_cast<const int8_t*>(m.p0) + ((size_t)e * m.rows + row) * m.cols + (size_t)c * CHUNK);
    }
    __device__ static void dequant(const Raw& r, float w[CHUNK], float sc[GROUPS]) {
        sc[0] = f16_bits_to_f(r.s);
        const uint32_t q[4] = {r.q.x ^ 0x80808080u, r.q.y ^ 0x80808080u, r.q.z ^ 0x80808080u,
                               r.q.w ^ 0x80808080u};
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) w[4 * j + i] = byte_to_f(q[j], i, MAGIC_2P23 + 128.f);
    }
};

struct EncQ4 {
    static constexpr int CHUNK = 32;
    static constexpr int GROUPS = 1;
    struct Raw { uint4 q; uint16_t s; };
    __device__ static Raw load(const Mat& m, int e, int row, int c) {
        const size_t r = (size_t)e * m.rows + row;
        Raw out;
        out.q = ld_stream16(static_cast<const uint8_t*>(m.p0) + r * (m.cols / 2) + (size_t)c * 16);
        out.s = __ldg(static_cast<const uint16_t*>(m.p1) + r * (m.cols / 32) + c);
        return out;
    }
    __device__ static void prefetch(const Mat& m, int e, int row, int c) {
        prefetch_l2(static_cast<const uint8_t*>(m.p0) + ((size_t)e * m.rows + row) * (m.cols / 2) + (size_t)c * 16);
    }
    __device__ static void dequant(const Raw& r, float w[CHUNK], float sc[GROUPS]) {
        sc[0] = f16_bits_to_f(r.s);
        const uint32_t q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const uint32_t lo = q[j] & 0x0f0f0f0fu;         // elements 8j + 0, 2, 4, 6
            const uint32_t hi = (q[j] >> 4) & 0x0f0f0f0fu;  // elements 8j + 1, 3, 5, 7
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                w[8 * j + 2 * i] = byte_to_f(lo, i, MAGIC_2P23 + 8.f);
                w[8 * j + 2 * i + 1] = byte_to_f(hi, i, MAGIC_2P23 + 8.f);
            }
        }
    }
};

// The eight q6_g64 codes of ql word w as bytes, element 2i's at byte i of `even` and 2i + 1's
// at byte i of `odd` (ql holds element 2i at byte i's low nibble, 2i + 1 at its high one);
// their high bits are the low (`up` false) or high 16 bits of qh word hw, element m at bits
// 2m. x holds those bits as two bytes, in the low byte of each 16-bit half; shifted by 4 and 8
// (even elements) or 2 and 6 (odd), each pair lands on bits 4-5 of its element's byte, the
// other bits of the shifts masked.
__device__ __forceinline__ void q6_code_bytes(uint32_t w, uint32_t hw, bool up, uint32_t& even, uint32_t& odd) {
    const uint32_t x = __byte_perm(hw, 0u, up ? 0x4342 : 0x4140);
    even = (w & 0x0f0f0f0fu) | (((x << 4) | (x << 8)) & 0x30303030u);
    odd = ((w >> 4) & 0x0f0f0f0fu) | (((x << 2) | (x << 6)) & 0x30303030u);
}

struct EncQ6 {
    static constexpr int CHUNK = 32;
    static constexpr int GROUPS = 1;
    struct Raw { uint4 ql; uint2 qh; uint16_t s; };
    __device__ static Raw load(const Mat& m, int e, int row, int c) {
        const size_t r = (size_t)e * m.rows + row;
        Raw out;
        out.ql = ld_stream16(static_cast<const uint8_t*>(m.p0) + r * (m.cols / 2) + (size_t)c * 16);
        out.qh = __ldg(reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(m.p1) +
                                                      r * (m.cols / 4) + (size_t)c * 8));
        out.s = __ldg(static_cast<const uint16_t*>(m.p2) + r * (m.cols / 64) + c / 2);
        return out;
    }
    __device__ static void prefetch(const Mat& m, int e, int row, int c) {
        prefetch_l2(static_cast<const uint8_t*>(m.p0) + ((size_t)e * m.rows + row) * (m.cols / 2) + (size_t)c * 16);
    }
    __device__ static void dequant(const Raw& r, float w[CHUNK], float sc[GROUPS]) {
        sc[0] = f16_bits_to_f(r.s);
        const uint32_t ql[4] = {r.ql.x, r.ql.y, r.ql.z, r.ql.w};
        const uint32_t qh[2] = {r.qh.x, r.qh.y};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            // ql word j holds elements 8j..8j+7; their high bits are the 16 bits of qh starting
            // at bit 16*(j%2) of qh word j/2.
            uint32_t even, odd;
            q6_code_bytes(ql[j], qh[j / 2], j % 2, even, odd);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                w[8 * j + 2 * i] = byte_to_f(even, i, MAGIC_2P23 + 32.f);
                w[8 * j + 2 * i + 1] = byte_to_f(odd, i, MAGIC_2P23 + 32.f);
            }
        }
    }
};

struct EncNvfp4 {
    static constexpr int CHUNK = 32;
    static constexpr int GROUPS = 2;  // one E4M3 scale per 16 elements
    struct Raw { uint4 q; uint16_t s; };
    __device__ static Raw load(const Mat& m, int e, int row, int c) {
        const size_t r = (size_t)e * m.rows + row;
        Raw out;
        out.q = ld_stream16(static_cast<const uint8_t*>(m.p0) + r * (m.cols / 2) + (size_t)c * 16);
        out.s = __ldg(reinterpret_cast<const uint16_t*>(static_cast<const uint8_t*>(m.p1) +
                                                        r * (m.cols / 16) + (size_t)c * 2));
        return out;
    }
    __device__ static void prefetch(const Mat& m, int e, int row, int c) {
        prefetch_l2(static_cast<const uint8_t*>(m.p0) + ((size_t)e * m.rows + row) * (m.cols / 2) + (size_t)c * 16);
    }
    __device__ static void dequant(const Raw& r, float w[CHUNK], float sc[GROUPS]) {
        const uint32_t q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        sc[0] = scale(r, 0);
        sc[1] = scale(r, 1);
#pragma unroll
        for (int j = 0; j < 4; ++j) dequant_word(q[j], w + 8 * j);
    }
    // Weights 8j..8j+7 of a chunk, E2M1 exactly, from its codes' word j (device layout).
    __device__ static void dequant_word(uint32_t q, float w[8]) {
        dequant_word_tiny(q, w);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] *= 0x1p126f;
    }
    // The same times 2^-126 (0.5 an f32 subnormal), for a caller that scales x instead: each
    // pair's bf16 halves (common.cuh) are the high halves of f32s.
    __device__ static void dequant_word_tiny(uint32_t q, float w[8]) {
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const uint32_t r = nvfp4_pair(q, p);
            w[2 * p] = __uint_as_float(r << 16);
            w[2 * p + 1] = __uint_as_float(r & 0xffff0000u);
        }
    }
    __device__ static float scale(const Raw& r, int g) { return e4m3_to_f((uint8_t)(r.s >> (8 * g))); }
};

// Per-row multiplier applied after the dot product: the nvfp4 global of the row's segment.
template <typename Enc>
__device__ __forceinline__ float row_multiplier(const Mat& m, int e, int row) {
    return 1.0f;
}
template <>
__device__ __forceinline__ float row_multiplier<EncNvfp4>(const Mat& m, int e, int row) {
    const int seg = row / (m.rows / m.segments);
    return __ldg(m.global + (size_t)e * m.segments + seg);
}
