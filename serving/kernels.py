"""A CPU paged-attention kernel for decoding: each sequence's one query attends over its keys and values
where they lie in the paged pool, block by block, without first gathering them into a contiguous batch.

In plain PyTorch (`pylon.serving.attention`) a decode step copies every sequence's blocks into a workspace
(`index_select`) and then runs two batched matmuls over the copy; the copy was a third of a 32-sequence decode
step. This kernel reads each (sequence, kv head)'s blocks once, in place: scores for all the query heads that
share the kv head, a softmax, and the weighted sum of values, in parallel over (sequence, kv head) pairs on
torch's intra-op threads. It is what vLLM's CPU backend does with its own paged-attention kernels.

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

NAME = "pylon_paged_attention_v1"

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <algorithm>

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

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t b = idx / KVH, kh = idx % KVH;
      const int64_t len = lp[b];
      TORCH_CHECK(len > 0 && len <= MB * BS, "paged_decode: context length out of range");
      scores.assign(share * len, 0.f);
      acc.assign(share * D, 0.f);
      const float* qrow0 = qp + (b * H + kh * share) * D;
      // Scores: for every key of every block, one dot product per query head of this kv head.
      for (int64_t pos0 = 0, j = 0; pos0 < len; pos0 += BS, ++j) {
        const int64_t blk = tp[b * MB + j];
        TORCH_CHECK(blk >= 0 && blk < NB, "paged_decode: block id out of range");
        const float* kblock = kp + ((kh * NB + blk) * BS) * D;
        const int64_t n = std::min(BS, len - pos0);
        for (int64_t t = 0; t < n; ++t) {
          const float* krow = kblock + t * D;
          for (int64_t s = 0; s < share; ++s) {
            const float* qrow = qrow0 + s * D;
            float dot = 0.f;
            #pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; ++d) dot += qrow[d] * krow[d];
            scores[s * len + pos0 + t] = dot * fscale;
          }
        }
      }
      // Softmax per query head.
      for (int64_t s = 0; s < share; ++s) {
        float* row = scores.data() + s * len;
        float mx = row[0];
        for (int64_t i = 1; i < len; ++i) mx = std::max(mx, row[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < len; ++i) { row[i] = std::exp(row[i] - mx); sum += row[i]; }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < len; ++i) row[i] *= inv;
      }
      // Weighted sum of values, block by block.
      for (int64_t pos0 = 0, j = 0; pos0 < len; pos0 += BS, ++j) {
        const int64_t blk = tp[b * MB + j];
        const float* vblock = vp + ((kh * NB + blk) * BS) * D;
        const int64_t n = std::min(BS, len - pos0);
        for (int64_t t = 0; t < n; ++t) {
          const float* vrow = vblock + t * D;
          for (int64_t s = 0; s < share; ++s) {
            const float p = scores[s * len + pos0 + t];
            float* a = acc.data() + s * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; ++d) a[d] += p * vrow[d];
          }
        }
      }
      for (int64_t s = 0; s < share; ++s) {
        std::copy(acc.begin() + s * D, acc.begin() + (s + 1) * D, op + (b * H + kh * share + s) * D);
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
