"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS, GLM-4.5): each token's hidden state goes to
the `top_k` of `num_experts` gated MLPs its router picks, and their outputs, weighted by the router, are summed.

The loaded model's sparse MoE blocks are replaced at load by `SparseMoE`, which computes what transformers' block
computes (its router, then its experts) from the block's own weights:

1. Router: logits = x @ router^T; probabilities = softmax in float32; the top_k of them, divided by their sum where
   the family renormalises (Mixtral always; Qwen's `norm_topk_prob`). Qwen's weights are cast to the model's dtype
   before they scale the experts' outputs (its router does); Mixtral's stay float32.
2. Experts: the step's (token, expert) pairs sorted by expert, so each expert runs once over the rows that chose it
   (two matmuls: gate and up in one `[2 x intermediate, hidden]` weight, then down, `down(act(gate) * up)`), and the
   weighted outputs scatter-added back to their tokens in expert order, as transformers adds them. An expert no
   token chose costs nothing. Batching mixes requests freely: routing is per token.
3. Qwen2-MoE's shared expert: a dense MLP every token runs, scaled by sigmoid(shared_expert_gate(x)), added;
   GLM-4.5's shared experts likewise, unscaled.

GLM-4.5's router (Glm4MoeTopkRouter, DeepSeek-V3's "noaux_tc") differs in step 1: sigmoid scores in float32, a
correction bias (`e_score_correction_bias`) added to them to choose, within the best `topk_group` of `n_group`
groups of experts, and the chosen experts weighted by their uncorrected scores, renormalised, times
`routed_scaling_factor` (`SparseMoE._route_grouped`). DeepSeek-V2's (`topk_method`) softmaxes, chooses within the
groups whose best expert scores highest, and scales without renormalising (`SparseMoE._route_v2`).

ERNIE 4.5's (`moe_statics`) chooses by its softmax probabilities plus a correction bias and weights the chosen by
the plain ones, renormalised with their sum clamped at `moe_norm_min`.

GPT-OSS's blocks (`router` for `gate`) differ in each part, as GptOssTopKRouter and GptOssExperts compute them: the
router has a bias and softmaxes its top_k logits among themselves (in the model's dtype); each expert's weights are
stored `[in, out]` (used as they are: `x @ w + b`, no copy) with biases on both projections, and its activation is a
clamped SwiGLU over interleaved gate and up columns (`SparseMoE._glu`).

A step's routing is read back to the host once per layer (how many rows each expert takes), which CUDA graphs cannot
capture. So on a GPU, where torch has a grouped matmul (`torch.nn.functional.grouped_mm`, compute capability 8.0 and
newer) and it agrees with the loop on the device at load (`grouped_usable`), the float experts run as two grouped
matmuls instead (`SparseMoE.grouped`): the same sort by expert, each expert's row count and offsets computed on the
device, one kernel over all experts for gate and up and one for down, nothing read back, so the decode steps are
captured as CUDA graphs like a dense model's (pylon.serving.model.graphs). On a CPU the loop stays (it is on par with
torch's grouped matmul there, and the quantized experts need it); the tests run the grouped path on a CPU too.

Each expert's two weights go through the runner's projections (`project`): int8 or fp8 weights quantized per expert and
output channel (`engine.quantization`: the experts are most of an MoE model's bytes), else the float weights
themselves, through torch's matmul: oneDNN's reordered weights (pylon.serving.model.linear) compile a kernel per row
count, and an expert's row count changes every step. The router stays in float (vLLM keeps the gate unquantized too).

With expert parallelism (a tensor-parallel shard holding a share of the experts whole: pylon.serving.model.tensor),
the block routes over all of the router's experts, then computes the rows of its own (`first_expert` on; contiguous
in the sorted order) and its shared expert's slice; the shards' outputs are summed by the caller's all-reduce.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


def is_sparse_block(module: torch.nn.Module) -> bool:
    """Whether `module` is one of transformers' sparse MoE blocks (a router, `gate` or GPT-OSS's `router`, and 3-D
    `experts` weights)."""
    experts = getattr(module, "experts", None)
    return (
        experts is not None
        and (hasattr(module, "gate") or hasattr(module, "router"))
        and getattr(getattr(experts, "gate_up_proj", None), "dim", lambda: 0)() == 3
    )


def _grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows `x` grouped by expert (`offsets`: each group's end) times each group's `[in, out]` weight."""
    return F.grouped_mm(x, weight_t, offs=offsets)


@functools.cache
def grouped_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `SparseMoE`'s grouped path runs on `device` in `dtype` and computes what the loop computes (once per
    process and device, on a small random block)."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return False
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        experts, hidden, inter, rows = 4, 64, 32, 12

        def rand(*shape):
            return (torch.randn(*shape, generator=g) * 0.1).to(device=device, dtype=dtype)

        block = _Block(rand(experts, 2 * inter, hidden), rand(experts, hidden, inter), rand(experts, hidden))
        moe = SparseMoE(block, _BlockConfig(top_k=2), None)
        x = rand(rows, hidden)
        want = moe(x)
        moe.grouped = True
        got = moe(x)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        ok = torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance)
    except (RuntimeError, TypeError, NotImplementedError) as e:  # no kernel for this device, dtype or alignment
        log.info("grouped matmul unavailable on %s in %s (%s): MoE experts run one by one", device, dtype, e)
        return False
    if not ok:
        log.warning(
            "grouped matmul disagrees with the experts' loop on %s in %s: MoE experts run one by one", device, dtype
        )
    return ok


class _Block(torch.nn.Module):
    """A sparse block's parts, as transformers' blocks hold them (for `grouped_usable`'s check)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, router: torch.Tensor):
        super().__init__()
        self.experts = torch.nn.Module()
        self.experts.gate_up_proj, self.experts.down_proj = gate_up, down
        self.experts.act_fn = torch.nn.SiLU()
        self.gate = torch.nn.Module()
        self.gate.weight = router


@dataclasses.dataclass
class _BlockConfig:
    top_k: int
    model_type: str = "mixtral"

    @property
    def num_experts_per_tok(self) -> int:
        return self.top_k


class _Dense(torch.nn.Module):
    """An expert's `[out, in]` weight as a projection: `x @ w^T + bias` (a view of the loaded 3-D weight; no copy);
    `transposed`: the weight is stored `[in, out]` (GPT-OSS's), and the projection is `x @ w + bias`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, transposed: bool = False):
        super().__init__()
        self.weight, self.bias, self.transposed = weight, bias, transposed
        self.out_features, self.in_features = weight.shape[::-1] if transposed else weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)


class SparseMoE(torch.nn.Module):
    """A sparse MoE block of the loaded model (see above), computed over `[tokens, hidden]` rows.

    `project(linear)` turns an expert's weight, as an `nn.Linear`, into the runner's projection for it (a quantized
    one); None: the experts keep their float weights (views of the loaded ones, no copy). The shared expert stays the
    loaded module, whose projections the runner converts as it does the attention's (`shared`)."""

    def __init__(
        self,
        block: torch.nn.Module,
        config,
        project: Callable[[torch.nn.Linear], torch.nn.Module] | None,
        first_expert: int | None = None,
    ):
        """`first_expert`: the block holds experts `first_expert ...` of the router's only (a tensor-parallel shard's,
        with expert parallelism: pylon.serving.model.tensor), and computes their share of each token's output."""
        super().__init__()
        experts = block.experts
        self.top_k = config.num_experts_per_tok
        # GPT-OSS (families.py): a router with a bias that softmaxes its top_k logits; experts stored [in, out] with
        # biases, a clamped SwiGLU over interleaved gate and up columns.
        self.gpt_oss = hasattr(block, "router") and config.model_type != "llama4_text"
        # Llama 4 (families.py): the sigmoid of each token's top_k logits scales its input to those experts (not their
        # outputs); experts stored [in, out], gate and up as halves; a shared expert.
        self.llama4 = config.model_type == "llama4_text"
        # Mixtral's router always renormalises its top_k; Qwen's where the config says (norm_topk_prob).
        # (Qwen3.5-MoE's router renormalises always: its config has no norm_topk_prob)
        self.renormalise = config.model_type in ("mixtral", "qwen3_5_moe_text") or bool(
            getattr(config, "norm_topk_prob", False)
        )
        self.scores_in_model_dtype = config.model_type != "mixtral"
        router = block.router if self.gpt_oss or self.llama4 else block.gate
        self.router = router.weight.detach()  # [num_experts, hidden]
        # Expert parallelism: the router's experts are all of the model's; this block computes `held` of them.
        held = experts.gate_up_proj.shape[0]
        self.held = None if first_expert is None else range(first_expert, first_expert + held)
        self.num_experts = self.router.shape[0]
        self.router_bias = router.bias.detach() if getattr(router, "bias", None) is not None else None
        # GLM-4.5's (DeepSeek-V3's) router: sigmoid scores; experts chosen by the scores plus a correction bias within
        # the best topk_group of n_group groups; weighted by their own scores, renormalised, times a scaling factor.
        # DeepSeek-V2's router: softmax scores, the top_k (within the best topk_group groups by their best expert, for
        # "group_limited_greedy"), not renormalised, times routed_scaling_factor.
        self.v2_method = getattr(router, "topk_method", None)
        if self.v2_method is not None:
            self.groups, self.topk_group = router.num_group, router.topk_group
            self.routed_scaling = float(router.routed_scaling_factor)
        # ERNIE 4.5's router (Ernie4_5_MoeTopKRouter): softmax probabilities in float32; experts chosen by them plus a
        # correction bias (`moe_statics`), weighted by the plain ones renormalised (their sum clamped at norm_min).
        statics = getattr(router, "moe_statics", None)
        self.ernie_bias = None if statics is None else statics.e_score_correction_bias.detach().reshape(-1).float()
        self.norm_min = getattr(router, "norm_min", None)
        correction = getattr(router, "e_score_correction_bias", None)
        self.correction = None if correction is None else correction.detach()
        if self.correction is not None:
            self.groups, self.topk_group = router.num_group, router.topk_group
            self.routed_scaling = float(router.routed_scaling_factor)
            self.renormalise = bool(router.norm_topk_prob)
        self.act = None if self.gpt_oss else experts.act_fn
        self.alpha, self.limit = (experts.alpha, experts.limit) if self.gpt_oss else (None, None)
        transposed = self.gpt_oss or self.llama4  # GptOssExperts' and Llama4TextExperts' are [experts, in, out]

        def expert(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Module:
            bias = None if bias is None else bias.detach()
            if project is None:
                return _Dense(weight.detach(), bias, transposed)
            weight = weight.detach().t() if transposed else weight.detach()
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
            linear.weight = torch.nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                linear.bias = torch.nn.Parameter(bias, requires_grad=False)
            return project(linear)

        gate_up_bias = getattr(experts, "gate_up_proj_bias", None)
        down_bias = getattr(experts, "down_proj_bias", None)
        held = experts.gate_up_proj.shape[0]  # (the router's all, or expert parallelism's share of them)
        self.gate_up = torch.nn.ModuleList(
            expert(experts.gate_up_proj[e], None if gate_up_bias is None else gate_up_bias[e]) for e in range(held)
        )
        self.down = torch.nn.ModuleList(
            expert(experts.down_proj[e], None if down_bias is None else down_bias[e]) for e in range(held)
        )
        # The grouped path (float experts only): each expert's weights as `[in, out]` views of the loaded ones.
        self.grouped = False

        def as_in_out(w: torch.Tensor) -> torch.Tensor | None:
            return None if project is not None else w.detach() if transposed else w.detach().transpose(-2, -1)

        self._gate_up_t, self._down_t = as_in_out(experts.gate_up_proj), as_in_out(experts.down_proj)
        self._gate_up_bias = None if gate_up_bias is None else gate_up_bias.detach()
        self._down_bias = None if down_bias is None else down_bias.detach()
        # Qwen2-MoE's shared expert (a dense MLP module, gated), GLM-4.5's shared experts (one dense MLP, ungated)
        self.shared = getattr(block, "shared_expert", None)
        if self.shared is None:
            self.shared = getattr(block, "shared_experts", None)
        gate = getattr(block, "shared_expert_gate", None)
        self.shared_gate = None if gate is None else gate.weight.detach()  # [1, hidden]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top_k experts `[rows, top_k]` and their weights, as the family's router computes them."""
        if self.gpt_oss:  # GptOssTopKRouter: the top_k logits, softmaxed among themselves in the model's dtype
            top, experts = torch.topk(F.linear(x, self.router, self.router_bias), self.top_k, dim=-1)
            return experts, torch.softmax(top, dim=1, dtype=top.dtype)
        if self.llama4:  # Llama4Router: the sigmoid of the top_k logits (in float32, then the model's dtype)
            top, experts = torch.topk(F.linear(x, self.router), self.top_k, dim=-1)
            return experts, torch.sigmoid(top.float()).to(x.dtype)
        if self.ernie_bias is not None:
            probs = torch.softmax(F.linear(x.float(), self.router.float()), dim=-1, dtype=torch.float32)
            experts = torch.topk(probs + self.ernie_bias, self.top_k, dim=-1)[1]
            weights = probs.gather(1, experts)
            weights = weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=self.norm_min)
            return experts, weights.to(x.dtype)
        if self.correction is not None:
            return self._route_grouped(x)
        if self.v2_method is not None:
            return self._route_v2(x)
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scores_in_model_dtype:
            weights = weights.to(x.dtype)
        return experts, weights

    def _route_grouped(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Glm4MoeTopkRouter's (DeepSeek-V3's noaux_tc) routing, in float32 as it computes it: each group's score the
        sum of its best two corrected scores, the best topk_group groups' experts eligible, their top_k chosen by the
        corrected scores and weighted by the plain ones (renormalised where norm_topk_prob), times routed_scaling."""
        scores = F.linear(x.float(), self.router.float()).sigmoid()
        choice = scores + self.correction
        rows, per_group = len(x), self.num_experts // self.groups
        group_scores = choice.view(rows, self.groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        eligible = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        eligible = eligible[:, :, None].expand(rows, self.groups, per_group).reshape(rows, self.num_experts)
        experts = torch.topk(choice.masked_fill(~eligible, float("-inf")), k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if self.renormalise:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * self.routed_scaling

    def _route_v2(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepseekV2TopkRouter's routing, in float32 as it computes it: softmax scores; "greedy": their top_k;
        "group_limited_greedy": the top_k of the experts in the topk_group groups whose best score is highest; the
        weights the scores themselves, times routed_scaling_factor."""
        scores = F.linear(x.float(), self.router.float()).softmax(dim=-1, dtype=torch.float32)
        if self.v2_method == "group_limited_greedy":
            rows, per_group = len(x), self.num_experts // self.groups
            group_scores = scores.view(rows, self.groups, per_group).max(dim=-1).values
            groups = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            eligible = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
            eligible = eligible[:, :, None].expand(rows, self.groups, per_group).reshape(rows, self.num_experts)
            scores = scores.masked_fill(~eligible, 0.0)
        weights, experts = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return experts, weights * self.routed_scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.grouped:
            return self._forward_grouped(x).view(shape)
        experts, weights = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one read back to the host
        if self.held is not None:  # expert parallelism: the rows of this block's experts only (contiguous: sorted)
            start = sum(counts[: self.held.start])
            order = order[start : start + sum(counts[self.held.start : self.held.stop])]
            counts = counts[self.held.start : self.held.stop]
        tokens = order // self.top_k
        rows = x[tokens]
        scaled = weights.reshape(-1)[order, None]
        if self.llama4:  # the weights scale the experts' inputs
            rows, scaled = rows * scaled, None
        outputs = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            outputs.append(self.down[e](self._glu(self.gate_up[e](rows[start : start + n]))))
            start += n
        if not outputs:  # no rows (or, with expert parallelism, none for this block's experts): the shared expert's
            return self._summed(x, tokens, x.new_zeros((0, x.shape[-1]))).view(shape)
        y = torch.cat(outputs) if scaled is None else torch.cat(outputs) * scaled
        return self._summed(x, tokens, y).view(shape)

    def _forward_grouped(self, x: torch.Tensor) -> torch.Tensor:
        """`forward`'s arithmetic with no value read back to the host (see above): static shapes, capturable."""
        experts, weights = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order // self.top_k
        # torch.histc counts floats on a CPU and integers on a GPU; bincount on a GPU reads its maximum back
        counted = flat.float() if x.device.type == "cpu" else flat.int()
        counts = torch.histc(counted, bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        scaled = weights.reshape(-1)[order, None]
        rows = x[tokens] * scaled if self.llama4 else x[tokens]  # Llama 4: the weights scale the experts' inputs
        gate_up = _grouped_mm(rows, self._gate_up_t, offsets)
        sorted_experts = flat[order]
        if self._gate_up_bias is not None:  # GPT-OSS: each row's expert's biases
            gate_up = gate_up + self._gate_up_bias[sorted_experts]
        y = _grouped_mm(self._glu(gate_up), self._down_t, offsets)
        if self._down_bias is not None:
            y = y + self._down_bias[sorted_experts]
        return self._summed(x, tokens, y if self.llama4 else y * scaled)

    def _glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The experts' gated activation of their gate and up projections (one tensor, `[rows, 2 x intermediate]`):
        `act(gate) * up` over its two halves, or GPT-OSS's clamped SwiGLU over interleaved columns (GptOssExperts'
        `_apply_gate`: gate clamped above at `limit`, up to +-limit, `(up + 1) * gate * sigmoid(alpha * gate)`)."""
        if not self.gpt_oss:
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act(gate) * up
        gate, up = gate_up[..., ::2].clamp(max=self.limit), gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _summed(self, x: torch.Tensor, tokens: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each token's weighted expert outputs `y` (rows in expert order, their tokens `tokens`) summed, plus the
        shared expert's output where the block has one."""
        out = torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))
        if self.shared is not None and self.shared_gate is None:
            return out + self.shared(x)
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out


def replace_blocks(
    model: torch.nn.Module,
    project: Callable[[torch.nn.Linear], torch.nn.Module] | None,
    *,
    grouped: bool = False,
    first_expert: int | None = None,
) -> int:
    """Every decoder layer's sparse MoE block of `model` (a transformers causal LM) as a `SparseMoE` (its experts
    through `project`, see there), the block's 3-D expert weights released where `project` made copies of them;
    `grouped`: their float experts through the grouped path (see above); `first_expert`: the blocks hold the router's
    experts from this one on only (expert parallelism; the loop computes them). Returns how many were replaced."""
    n = 0
    for layer in model.model.layers:
        if is_sparse_block(getattr(layer, "mlp", None)):  # (None: a layer another pipeline stage holds)
            layer.mlp = SparseMoE(layer.mlp, model.config, project, first_expert)
            layer.mlp.grouped = grouped and project is None and first_expert is None
            n += 1
    return n
