"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE): each token's hidden state goes to the `top_k` of
`num_experts` gated MLPs its router picks, and their outputs, weighted by the router, are summed.

The loaded model's sparse MoE blocks are replaced at load by `SparseMoE`, which computes what transformers' block
computes (its router, then its experts) from the block's own weights:

1. Router: logits = x @ router^T; probabilities = softmax in float32; the top_k of them, divided by their sum where
   the family renormalises (Mixtral always; Qwen's `norm_topk_prob`). Qwen's weights are cast to the model's dtype
   before they scale the experts' outputs (its router does); Mixtral's stay float32.
2. Experts: the step's (token, expert) pairs sorted by expert, so each expert runs once over the rows that chose it
   (two matmuls: gate and up in one `[2 x intermediate, hidden]` weight, then down, `down(act(gate) * up)`), and the
   weighted outputs scatter-added back to their tokens in expert order, as transformers adds them. An expert no
   token chose costs nothing. Batching mixes requests freely: routing is per token.
3. Qwen2-MoE's shared expert: a dense MLP every token runs, scaled by sigmoid(shared_expert_gate(x)), added.

A step's routing is read back to the host once per layer (how many rows each expert takes), which CUDA graphs cannot
capture: an MoE model's decode steps run eagerly on a GPU (vLLM's fused MoE kernel is what removes that; not here).

Each expert's two weights go through the runner's projections (`project`): int8 or fp8 weights quantized per expert and
output channel (`engine.quantization`: the experts are most of an MoE model's bytes), else the float weights
themselves, through torch's matmul: oneDNN's reordered weights (pylon.serving.model.linear) compile a kernel per row
count, and an expert's row count changes every step. The router stays in float (vLLM keeps the gate unquantized too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def is_sparse_block(module: torch.nn.Module) -> bool:
    """Whether `module` is one of transformers' sparse MoE blocks (a router `gate` and 3-D `experts` weights)."""
    experts = getattr(module, "experts", None)
    return (
        experts is not None
        and hasattr(module, "gate")
        and getattr(getattr(experts, "gate_up_proj", None), "dim", lambda: 0)() == 3
    )


class _Dense(torch.nn.Module):
    """An expert's `[out, in]` weight as a projection: `x @ w^T` (a view of the loaded 3-D weight; no copy)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoE(torch.nn.Module):
    """A sparse MoE block of the loaded model (see above), computed over `[tokens, hidden]` rows.

    `project(linear)` turns an expert's weight, as an `nn.Linear`, into the runner's projection for it (a quantized
    one); None: the experts keep their float weights (views of the loaded ones, no copy). The shared expert stays the
    loaded module, whose projections the runner converts as it does the attention's (`shared`)."""

    def __init__(self, block: torch.nn.Module, config, project: Callable[[torch.nn.Linear], torch.nn.Module] | None):
        super().__init__()
        experts = block.experts
        self.num_experts = experts.gate_up_proj.shape[0]
        self.top_k = config.num_experts_per_tok
        # Mixtral's router always renormalises its top_k; Qwen's where the config says (norm_topk_prob).
        self.renormalise = config.model_type == "mixtral" or bool(getattr(config, "norm_topk_prob", False))
        self.scores_in_model_dtype = config.model_type != "mixtral"
        self.router = block.gate.weight.detach()  # [num_experts, hidden]
        self.act = experts.act_fn
        self.intermediate = experts.gate_up_proj.shape[1] // 2

        def expert(weight: torch.Tensor) -> torch.nn.Module:
            if project is None:
                return _Dense(weight.detach())
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
            linear.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
            return project(linear)

        self.gate_up = torch.nn.ModuleList(expert(experts.gate_up_proj[e]) for e in range(self.num_experts))
        self.down = torch.nn.ModuleList(expert(experts.down_proj[e]) for e in range(self.num_experts))
        self.shared = getattr(block, "shared_expert", None)  # Qwen2-MoE: a dense MLP module
        self.shared_gate = None if self.shared is None else block.shared_expert_gate.weight.detach()  # [1, hidden]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's top_k experts `[rows, top_k]` and their weights, as the family's router computes them."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.scores_in_model_dtype:
            weights = weights.to(x.dtype)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights = self.route(x)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert, tokens in order
        tokens = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # the one read back to the host
        rows = x[tokens]
        outputs = []
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate, up = self.gate_up[e](rows[start : start + n]).chunk(2, dim=-1)
            outputs.append(self.down[e](self.act(gate) * up))
            start += n
        if not outputs:  # no rows
            return x.view(shape).clone()
        y = torch.cat(outputs) * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add_(0, tokens, y.to(x.dtype))
        if self.shared is not None:
            out = out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared(x)
        return out.view(shape)


def replace_blocks(model: torch.nn.Module, project: Callable[[torch.nn.Linear], torch.nn.Module] | None) -> int:
    """Every decoder layer's sparse MoE block of `model` (a transformers causal LM) as a `SparseMoE` (its experts
    through `project`, see there), the block's 3-D expert weights released where `project` made copies of them.
    Returns how many were replaced."""
    n = 0
    for layer in model.model.layers:
        if is_sparse_block(layer.mlp):
            layer.mlp = SparseMoE(layer.mlp, model.config, project)
            n += 1
    return n
