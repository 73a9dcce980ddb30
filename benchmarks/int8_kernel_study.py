"""A study, not a feature: would a hand-written int8 weight-only kernel make ``rollout_precision="int8"`` pay?

``rollout_precision="int8"`` multiplies bf16 activations by int8 weights with torch's ``_weight_int8pack_mm``, and a
decode step with it runs at 0.72–1.27× a float32 model's on the CPUs measured (benchmarks/RESULTS.md, "Rollout
precision"): short of the issue's 1.8×. That kernel may simply be slow. This compiles two small kernels of our own
(C, OpenMP, ``-march=native``; a C compiler on PATH is needed) computing exactly what grpokit's int8 copies compute,
``bf16( s_n · Σ_k bf16(x_mk) · q_nk )``:

- ``hand-f32``: each int8 weight widened to float32 and multiplied by FMA (AVX-512, or AVX2), four weight rows by
  eight activation rows per tile (the activations padded to whole tiles), accumulators in registers, parallel over
  output rows;
- ``hand-bf16``: the same tile with AVX512-BF16's dot product (``vdpbf16ps``: the weights widened to bf16, exactly,
  two products per lane and instruction), where the CPU has it;

and times them against torch's int8 kernel, bf16 weights packed for oneDNN (what ``auto`` samples with on a CPU with
AMX) and float32 weights packed for oneDNN, on the 211 products of one SmolLM2-135M decode step (30 layers × q, k, v,
o, gate, up, down, and the head; random weights, quantised as grpokit does), at 8 and 32 rows. It also measures the
cores' float32 FMA rate with no memory traffic at all (a register-only loop on every thread): a decode step's
``2 · rows · 135M`` flops divided by that rate is the least time any kernel computing in float32 can take.

Prints a table; writes nothing.

    python benchmarks/int8_kernel_study.py
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/int8_kernel_study.py --march x86-64-v3
        # every kernel as on a CPU with AVX2 and FMA only (no AVX-512, no bf16 units)
"""

from __future__ import annotations

import argparse
import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpokit.rollout.packed import packable_dtypes  # noqa: E402
from grpokit.rollout.precision import quantize_int8  # noqa: E402

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#include <omp.h>

static inline float round_bf16(float v) {
    uint32_t u; memcpy(&u, &v, 4);
    if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &u, 4); return v;
}

#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
static inline vf vzero(void) { return _mm512_setzero_ps(); }
static inline vf vload(const float *p) { return _mm512_loadu_ps(p); }
static inline vf vq(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
#else
#define VW 8
typedef __m256 vf;
static inline vf vzero(void) { return _mm256_setzero_ps(); }
static inline vf vload(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vq(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s)); s = _mm_add_ss(s, _mm_movehdup_ps(s)); return _mm_cvtss_f32(s);
}
#endif

#define NT 4  /* weight rows per tile */
#define MT 8  /* activation rows per tile */

/* y (M, N) float32 = bf16(s[n] * sum_k x[m, k] * q[n, k]), x already rounded to bf16 values; M a multiple of MT,
   N of NT, K of 16. Each tile widens NT rows of int8 weights to float32 once per 16 (AVX-512) or 8 inputs and
   multiplies them with MT activation rows: NT * MT accumulators in registers. */
void int8_mm_f32(const float *x, int M, int K, const int8_t *q, const float *s, int N, float *y) {
    #pragma omp parallel for schedule(static)
    for (int n0 = 0; n0 < N; n0 += NT)
        for (int m0 = 0; m0 < M; m0 += MT) {
            vf acc[NT][MT];
            for (int j = 0; j < NT; j++) for (int m = 0; m < MT; m++) acc[j][m] = vzero();
            for (int k = 0; k < K; k += VW) {
                vf w[NT];
                for (int j = 0; j < NT; j++) w[j] = vq(q + (size_t)(n0 + j) * K + k);
                for (int m = 0; m < MT; m++) {
                    vf xv = vload(x + (size_t)(m0 + m) * K + k);
                    for (int j = 0; j < NT; j++) acc[j][m] = vfma(w[j], xv, acc[j][m]);
                }
            }
            for (int j = 0; j < NT; j++) for (int m = 0; m < MT; m++)
                y[(size_t)(m0 + m) * N + n0 + j] = round_bf16(s[n0 + j] * vsum(acc[j][m]));
        }
}

int has_bf16_dot(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* the same with AVX512-BF16's dot product (two products per lane and instruction): x as bf16 bits (M, K), the
   weights widened to bf16 (exact: |q| <= 127); K a multiple of 32 */
void int8_mm_bf16(const uint16_t *x, int M, int K, const int8_t *q, const float *s, int N, float *y) {
#if defined(__AVX512BF16__)
    #pragma omp parallel for schedule(static)
    for (int n0 = 0; n0 < N; n0 += NT)
        for (int m0 = 0; m0 < M; m0 += MT) {
            __m512 acc[NT][MT];
            for (int j = 0; j < NT; j++) for (int m = 0; m < MT; m++) acc[j][m] = _mm512_setzero_ps();
            for (int k = 0; k < K; k += 32) {
                __m512bh w[NT];
                for (int j = 0; j < NT; j++) {
                    const int8_t *p = q + (size_t)(n0 + j) * K + k;
                    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
                    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
                    w[j] = _mm512_cvtne2ps_pbh(hi, lo);
                }
                for (int m = 0; m < MT; m++) {
                    __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + (size_t)(m0 + m) * K + k));
                    for (int j = 0; j < NT; j++) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], w[j], xv);
                }
            }
            for (int j = 0; j < NT; j++) for (int m = 0; m < MT; m++)
                y[(size_t)(m0 + m) * N + n0 + j] = round_bf16(s[n0 + j] * _mm512_reduce_add_ps(acc[j][m]));
        }
#endif
}

/* float32 FMAs from registers only, on every thread: returns the flops done (2 per lane and FMA) */
double fma_flops(long iters) {
    double total = 0;
    #pragma omp parallel reduction(+:total)
    {
        float ones[16];
        for (int i = 0; i < 16; i++) ones[i] = 1e-7f;
        vf a[12], b = vload(ones);
        for (int i = 0; i < 12; i++) a[i] = vzero();
        for (long it = 0; it < iters; it++)
            for (int i = 0; i < 12; i++) a[i] = vfma(a[i], b, b);
        float sink = 0;
        for (int i = 0; i < 12; i++) sink += vsum(a[i]);
        total = 2.0 * VW * 12 * iters + (sink == 12345.f);
    }
    return total;
}
"""

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 \
    + [(49152, 576)]
"""(out, in) of the products of one SmolLM2-135M decode step: q, k, v, o, gate, up, down per layer, then the head."""


def build(work: Path, march: str = "native") -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("int8_kernel_study: needs a C compiler on PATH (cc or gcc)")
    (work / "int8_mm.c").write_text(SOURCE)
    subprocess.run([cc, "-O3", f"-march={march}", "-fopenmp", "-shared", "-fPIC", str(work / "int8_mm.c"), "-o",
                    str(work / "int8_mm.so")], check=True)
    lib = ctypes.CDLL(str(work / "int8_mm.so"))  # torch's libgomp is loaded already: the same OpenMP threads
    for name in ("int8_mm_f32", "int8_mm_bf16"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                       ctypes.c_void_p]
    lib.has_bf16_dot.restype = ctypes.c_int
    lib.fma_flops.restype = ctypes.c_double
    lib.fma_flops.argtypes = [ctypes.c_long]
    return lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--march", default="native",
                        help="the kernels' target (gcc's -march): x86-64-v3 for AVX2 and FMA only")
    a = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as work:
        lib = build(Path(work), a.march)
        weights = [torch.randn(o, i) * 0.02 for o, i in SHAPES]
        int8 = [quantize_int8(w) for w in weights]
        scales = [q.scale.float().contiguous() for q in int8]
        bf16_packs = torch.bfloat16 in packable_dtypes()  # else bf16 weights through F.linear (no bf16 units)
        bf16 = [torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16).contiguous(), 8) if bf16_packs
                else w.to(torch.bfloat16) for w in weights]
        f32 = [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 8) for w in weights]

        def hand(fn, bits):
            def run(x):  # the activations rounded to bf16 and padded to whole tiles of 8 rows, timed with the kernel
                rows = x.shape[0]
                xb = torch.nn.functional.pad(x.to(torch.bfloat16), (0, 0, 0, -rows % 8))
                xin = xb.view(torch.int16) if bits else xb.float()
                out = []
                for w, q, s in zip(weights, int8, scales):
                    xi = xin[:, :w.shape[1]].contiguous()
                    y = torch.empty(xi.shape[0], w.shape[0])
                    fn(xi.data_ptr(), xi.shape[0], w.shape[1], q.q.data_ptr(), s.data_ptr(), w.shape[0], y.data_ptr())
                    out.append(y[:rows])
                return out
            return run

        def torch_int8(x):
            xb = x.to(torch.bfloat16)
            return [torch.ops.aten._weight_int8pack_mm(xb[:, :w.shape[1]].contiguous(), q.q, q.scale)
                    for w, q in zip(weights, int8)]

        def packed(packs, dtype, is_packed=True):
            def run(x):
                xx = x.to(dtype)
                if not is_packed:
                    return [torch.nn.functional.linear(xx[:, :w.shape[1]], p) for w, p in zip(weights, packs)]
                return [torch.ops.mkldnn._linear_pointwise(xx[:, :w.shape[1]].contiguous(), p, None, "none", [], "")
                        for w, p in zip(weights, packs)]
            return run

        sides = {"hand-f32": hand(lib.int8_mm_f32, False)}
        if lib.has_bf16_dot():
            sides["hand-bf16"] = hand(lib.int8_mm_bf16, True)
        sides.update({"torch int8": torch_int8, "bf16 packed" if bf16_packs else "bf16": packed(bf16, torch.bfloat16, bf16_packs),
                      "float32 packed": packed(f32, torch.float32)})
        lib.fma_flops(1000)
        t = time.perf_counter()
        flops = lib.fma_flops(20_000_000)
        fma_rate = flops / (time.perf_counter() - t)
        params = sum(o * i for o, i in SHAPES)
        print(f"{torch.get_num_threads()} threads; float32 FMA from registers: {fma_rate / 1e9:.0f} GFLOP/s; "
              f"{params / 1e6:.0f}M weights in {len(SHAPES)} products")
        print("| rows | side | ms (median) | vs float32 packed | GFLOP/s | float32 FMA floor ms |")
        print("|---|---|---|---|---|---|")
        for rows in a.rows:
            x = torch.randn(rows, 1536)
            ref = [(x[:, :w.shape[1]].to(torch.bfloat16).float() @ q.dequantized().T) for w, q in
                   zip(weights[:7], int8[:7])]
            for name in [n for n in sides if n.startswith("hand")]:
                got = sides[name](x)[:7]
                err = max(float(((g - r).abs() / r.abs().amax()).max()) for g, r in zip(got, ref))
                assert err < 8e-3, (name, err)  # one bf16 rounding of the output
            times = {name: [] for name in sides}
            for _ in range(a.repeats):
                for name, fn in sides.items():
                    t = time.perf_counter()
                    fn(x)
                    times[name].append(time.perf_counter() - t)
            ms = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            floor = 2 * rows * params / fma_rate * 1e3
            for name, v in ms.items():
                print(f"| {rows} | {name} | {v:.1f} | {ms['float32 packed'] / v:.2f}× | "
                      f"{2 * rows * params / v / 1e6:.0f} | {floor:.1f} |")


if __name__ == "__main__":
    main()
