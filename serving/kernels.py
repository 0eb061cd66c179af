"""A CPU paged-attention kernel for decoding: each sequence's one query attends over its keys and values
where they lie in the paged pool, block by block, without first gathering them into a contiguous batch.

In plain PyTorch (`pylon.serving.attention`) a decode step copies every sequence's blocks into a workspace
(`index_select`) and then runs two batched matmuls over the copy; the copy was a third of a 32-sequence decode
step. This kernel reads each (sequence, kv head)'s blocks once, in place, in one pass with a running softmax
(flash-decoding's max / sum / rescaled accumulator) for all the query heads that share the kv head, in parallel
over (sequence, kv head) pairs on torch's intra-op threads, prefetching the next block's keys and values while
it computes one. It is what vLLM's CPU backend does with its own paged-attention kernels. A decode step reads
the whole live cache (32 sequences of 300 tokens: 20 MB per layer, far past the caches), so it is bound by
memory bandwidth: the one pass with prefetching reads at ~34 GB/s here where the earlier two-pass kernel read
at ~25 (a plain streaming sum reaches ~34 on this 2-core machine).

It is compiled once per machine by torch's C++ extension loader into `$TORCH_EXTENSIONS_DIR` (the same cache
as DeepSpeed's ops; `make setup` builds it, `python -m pylon.serving.kernels` builds it by hand). Where it
cannot be built or loaded (no compiler), or with `PYLON_PAGED_KERNEL=0`, the engine uses the PyTorch path,
with the same results up to float rounding. float32 only: half precision on a CPU is slow anyway, and CUDA
devices take the PyTorch path.
"""
from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

NAME = "pylon_paged_attention_v2"

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>
#include <algorithm>

// Blocks prefetched ahead of the one being computed: the pool is far larger than the caches, so decode
// attention waits on memory; one block ahead took it from ~25 to ~34 GB/s here (a 2-core EPYC).
#define PYLON_PREFETCH_AHEAD 1

static inline void prefetch_block(const float* p, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(p + i, 0, 1);
}

// q: [B, H, D]; k_cache, v_cache: [KVH, NB, BS, D]; block_tables: [B, MB] (int64); context_lens: [B] (int64).
// out: [B, H, D]. Query heads kh*share .. kh*share+share-1 read kv head kh.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "paged_decode: float32 only");
  TORCH_CHECK(block_tables.dtype() == torch::kInt64 && context_lens.dtype() == torch::kInt64,
              "paged_decode: int64 block tables and lengths");
  q = q.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: contiguous caches");
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), NB = k_cache.size(1), BS = k_cache.size(2);
  const int64_t MB = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0, "paged_decode: shape mismatch");
  const int64_t share = H / KVH;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = block_tables.data_ptr<int64_t>();
  const int64_t* lp = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int64_t block_floats = BS * D;

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(share * BS), acc(share * D), mx(share), sum(share);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, kh = idx % KVH;
      const int64_t len = lp[b];
      TORCH_CHECK(len > 0 && len <= MB * BS, "paged_decode: context length out of range");
      const int64_t nblocks = (len + BS - 1) / BS;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      const float* qrow0 = qp + (b * H + kh * share) * D;
      const int64_t* table = tp + b * MB;
      for (int64_t j = 0; j < nblocks && j < PYLON_PREFETCH_AHEAD; ++j) {
        const int64_t blk = table[j];
        if (blk >= 0 && blk < NB) {
          prefetch_block(kp + (kh * NB + blk) * block_floats, block_floats);
          prefetch_block(vp + (kh * NB + blk) * block_floats, block_floats);
        }
      }
      // One pass over the blocks with a running softmax (max, sum, rescaled accumulator per query head),
      // the next blocks' keys and values prefetched while this one is computed.
      for (int64_t j = 0; j < nblocks; ++j) {
        const int64_t blk = table[j];
        TORCH_CHECK(blk >= 0 && blk < NB, "paged_decode: block id out of range");
        if (j + PYLON_PREFETCH_AHEAD < nblocks) {
          const int64_t nxt = table[j + PYLON_PREFETCH_AHEAD];
          if (nxt >= 0 && nxt < NB) {
            prefetch_block(kp + (kh * NB + nxt) * block_floats, block_floats);
            prefetch_block(vp + (kh * NB + nxt) * block_floats, block_floats);
          }
        }
        const float* kblock = kp + (kh * NB + blk) * block_floats;
        const float* vblock = vp + (kh * NB + blk) * block_floats;
        const int64_t n = std::min(BS, len - j * BS);
        for (int64_t s = 0; s < share; ++s) {
          const float* qrow = qrow0 + s * D;
          float* sc = scores.data() + s * BS;
          float bmax = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) {
            const float* krow = kblock + t * D;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; ++d) dot += qrow[d] * krow[d];
            sc[t] = dot * fscale;
            bmax = std::max(bmax, sc[t]);
          }
          const float m = std::max(mx[s], bmax);
          const float correction = std::exp(mx[s] - m);  // 0 for the first block (mx = -inf)
          float* a = acc.data() + s * D;
          if (correction != 1.f) {
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] *= correction;
          }
          float total = sum[s] * correction;
          for (int64_t t = 0; t < n; ++t) {
            const float p = std::exp(sc[t] - m);
            total += p;
            const float* vrow = vblock + t * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vrow[d];
          }
          sum[s] = total;
          mx[s] = m;
        }
      }
      for (int64_t s = 0; s < share; ++s) {
        const float inv = 1.f / sum[s];
        const float* a = acc.data() + s * D;
        float* o = op + (b * H + kh * share + s) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
      }
    }
  });
  return out;
}
"""

_lock = threading.Lock()
_module = None
_failed: str | None = None


def enabled() -> bool:
    return os.environ.get("PYLON_PAGED_KERNEL", "1") not in ("0", "false", "no", "off")


def load(verbose: bool = False):
    """The compiled module (building it the first time on this machine), or None where it cannot be had."""
    global _module, _failed
    if _module is not None or _failed is not None or not enabled():
        return _module
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        try:
            from torch.utils.cpp_extension import load_inline

            from pylon.ops import venv_tools_first

            venv_tools_first()  # torch runs the `ninja` first on PATH: the venv's, as for every build of Pylon's

            _module = load_inline(
                name=NAME, cpp_sources=[_SOURCE], functions=["paged_decode"],
                extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                verbose=verbose)
        except Exception as e:  # no compiler, no headers, a build error: the PyTorch path still works
            _failed = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            log.warning("paged-attention kernel unavailable (%s); decoding uses the PyTorch path", _failed)
    return _module


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`[B, heads, head_dim]` attention output of one query per sequence; see the module's docstring."""
    module = load()
    if module is None:
        raise RuntimeError(f"the paged-attention kernel is not available: {_failed or 'disabled'}")
    return module.paged_decode(q, k_cache, v_cache, block_tables, context_lens, float(scale))


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and load() is not None


if __name__ == "__main__":
    import time

    started = time.perf_counter()
    mod = load(verbose=False)
    if mod is None:
        raise SystemExit(f"paged-attention kernel: not built ({_failed or 'disabled by PYLON_PAGED_KERNEL'})")
    print(f"paged-attention kernel ready ({time.perf_counter() - started:.1f}s)")
