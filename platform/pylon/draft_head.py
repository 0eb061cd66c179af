"""The EAGLE-3 drafting head as objective eagle3 trains it (pylon.jobs.eagle; docs/training.md, "Drafting heads"),
beside the frozen model: `Eagle3Head` (its parameters by EAGLE-3's checkpoint names, and `unrolled`, its drafts with
training-time test), `Eagle3Trainer` (the model and the head, what the DeepSpeed engine trains), and the head's config
(`head_config`). On the ground floor, as `pylon.models` is, so that the planner (`pylon.plan.activations`) runs the
same modules on the meta device to count their memory.

Draft k at row i is fed draft k - 1's output (before its norm) in place of g and the text's token at i + k + 1, at
position i + k; its queries attend the first draft's keys of the rows up to i (what the engine's head caught up on)
and its own earlier drafts' keys of row i (its chain), as the engine's drafts attend them (the serving side's
reader and runner: pylon.serving.model.eagle).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pylon.errors import PylonError

HEAD_ARCHITECTURE = "LlamaForCausalLMEagle3"


def aux_layers(layers: list[int] | None, n: int) -> tuple[int, ...]:
    """The layers of a model of `n` layers whose inputs the head reads: the spec's, or EAGLE-3's default 2, N // 2,
    N - 3; the fault named unless they are three of its layer inputs (1 .. n - 1)."""
    aux = tuple(layers) if layers else (2, n // 2, n - 3)
    if len(aux) != 3 or not all(0 < j < n for j in aux):
        raise PylonError(
            f"eagle3.aux_layers: {list(aux)} are not three of the model's {n} layers (1 .. {n - 1}, the inputs of "
            "those layers)"
        )
    return aux


def head_config(target, *, draft_vocab: int, aux: tuple[int, ...], intermediate_size: int | None):
    """The head's LlamaConfig for the model of config `target`: its widths, attention heads, norm and positions."""
    from transformers import LlamaConfig

    heads = target.num_attention_heads
    fields = dict(
        hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or getattr(target, "intermediate_size", None) or 4 * target.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target, "num_key_value_heads", None) or heads,
        head_dim=getattr(target, "head_dim", None) or target.hidden_size // heads,
        rms_norm_eps=getattr(target, "rms_norm_eps", 1e-6),
        max_position_embeddings=getattr(target, "max_position_embeddings", 2048),
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab,
        target_hidden_size=target.hidden_size,
        hidden_act="silu",
        tie_word_embeddings=False,
        architectures=[HEAD_ARCHITECTURE],
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux)},
    )
    rope = getattr(target, "rope_parameters", None)
    if rope:
        fields["rope_parameters"] = dict(rope)
    return LlamaConfig(**fields)


class _Layer(torch.nn.Module):
    """The head's decoder layer, by EAGLE-3's names (`midlayer.*`): attention over twice the width."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        width, eps = config.hidden_size, config.rms_norm_eps
        heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.input_layernorm = LlamaRMSNorm(width, eps)
        self.hidden_norm = LlamaRMSNorm(width, eps)
        self.self_attn = torch.nn.ModuleDict(
            {
                "q_proj": torch.nn.Linear(2 * width, heads * dim, bias=False),
                "k_proj": torch.nn.Linear(2 * width, kv * dim, bias=False),
                "v_proj": torch.nn.Linear(2 * width, kv * dim, bias=False),
                "o_proj": torch.nn.Linear(heads * dim, width, bias=False),
            }
        )
        self.post_attention_layernorm = LlamaRMSNorm(width, eps)
        self.mlp = torch.nn.ModuleDict(
            {
                "gate_proj": torch.nn.Linear(width, config.intermediate_size, bias=False),
                "up_proj": torch.nn.Linear(width, config.intermediate_size, bias=False),
                "down_proj": torch.nn.Linear(config.intermediate_size, width, bias=False),
            }
        )


class Eagle3Head(torch.nn.Module):
    """The head's parameters (named as EAGLE-3's checkpoints name them) and its draft vocabulary (`draft_tokens`, the
    model's ids, ascending: a buffer, in the checkpoints)."""

    def __init__(self, config, draft_tokens: torch.Tensor) -> None:
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        self.config = config
        width = config.hidden_size
        self.fc = torch.nn.Linear(3 * config.target_hidden_size, width, bias=False)
        self.midlayer = _Layer(config)
        self.norm = LlamaRMSNorm(width, config.rms_norm_eps)
        self.lm_head = torch.nn.Linear(width, len(draft_tokens), bias=False)
        self.register_buffer("draft_tokens", draft_tokens.long().clone())
        self.rotary = LlamaRotaryEmbedding(config)  # (its inv_freq: not persistent, never in a checkpoint)

    def unrolled(
        self,
        features: torch.Tensor,
        embeddings: torch.Tensor,
        positions: torch.Tensor,
        causal: torch.Tensor,
        steps: int,
    ) -> list[torch.Tensor]:
        """The head's logits over the draft vocabulary for `steps` drafts at every row: `features` [B, T, 3H] the
        model's three hidden states at i, `embeddings` [B, T, H] the text's token at i + 1's, `positions` [B, T] the
        rows' positions, `causal` [B, T, T] which rows each row's first draft attends (itself and those before in its
        document). Draft k at row i: fed draft k - 1's output and the token at i + k + 1, at position i + k."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        cfg = self.config
        B, T, _ = features.shape
        heads, kv, dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        scale = dim**-0.5
        g = self.fc(features)
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        out = []
        # Draft k's queries attend [the first draft's keys (causal within the document), the chain's own earlier
        # drafts' keys of the same row]: one mask over the keys side by side, so that scaled_dot_product_attention
        # runs it (a fused kernel on a GPU keeps no seq x seq scores for the backward pass)
        own = torch.eye(T, dtype=torch.bool, device=causal.device).expand(B, T, T)
        for k in range(steps):
            e = shifted(embeddings, k)
            x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(g)], dim=-1)
            q = attn["q_proj"](x).view(B, T, heads, dim).transpose(1, 2)
            key = attn["k_proj"](x).view(B, T, kv, dim).transpose(1, 2)
            value = attn["v_proj"](x).view(B, T, kv, dim).transpose(1, 2)
            cos, sin = self.rotary(x, positions + k)
            q, key = _rotate(q, key, cos, sin)
            key, value = (t.repeat_interleave(heads // kv, dim=1) for t in (key, value))
            keys.append(key)
            values.append(value)
            mask = torch.cat([causal, *[own] * k], dim=-1)[:, None]  # [B, 1, T, (k + 1) T]
            a = F.scaled_dot_product_attention(
                q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask, scale=scale
            )
            h = g + attn["o_proj"](a.transpose(1, 2).reshape(B, T, heads * dim))
            y = layer.post_attention_layernorm(h)
            h = h + layer.mlp["down_proj"](F.silu(layer.mlp["gate_proj"](y)) * layer.mlp["up_proj"](y))
            out.append(self.lm_head(self.norm(h)))
            g = h  # the next draft is fed this one's output before the norm
        return out


def draft_loss(draft: torch.Tensor, teacher: torch.Tensor, k: int) -> torch.Tensor:
    """Draft k's soft cross-entropy at every row [B, T]: against the model's distribution over the draft vocabulary at
    i + k + 1 (`teacher`: its logits there, every position)."""
    target = torch.softmax(shifted(teacher, k + 1), dim=-1)
    return -(target * torch.log_softmax(draft.float(), dim=-1)).sum(-1)


def shifted(t: torch.Tensor, k: int) -> torch.Tensor:
    """`t` [B, T, ...] moved k rows up (row i holds row i + k's), the last k rows repeating the last (never counted)."""
    if k == 0:
        return t
    return torch.cat([t[:, k:], t[:, -1:].expand(-1, k, *t.shape[2:])], dim=1)


def _rotate(q, k, cos, sin):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin)


class Eagle3Trainer(torch.nn.Module):
    """What the DeepSpeed engine trains for objective eagle3: the frozen model (`target`, always in eval mode, no
    gradients) and the head. `forward(input_ids, labels, ...)` returns a `pylon.models.TokenLoss`-shaped dict: the
    weighted soft cross-entropy of every counted draft summed (`loss_sum`), the first drafts counted (`tokens`), and
    per draft depth the drafts whose top token is the model's and the drafts counted (`stats`: 2 x ttt_steps)."""

    def __init__(self, target: torch.nn.Module, head: Eagle3Head, aux: tuple[int, ...], steps: int, decay: float):
        super().__init__()
        self.target = target.requires_grad_(False).eval()
        self.head = head
        self.aux = aux
        self.steps = steps
        self.decay = decay

    @property
    def config(self):
        return self.target.config

    def train(self, mode: bool = True):
        super().train(mode)
        self.target.eval()  # (no dropout in the teacher: the head learns the model as it serves)
        return self

    def drafts(self, input_ids, attention_mask=None, position_ids=None):
        """The head's logits over its draft vocabulary, a tensor [B, T, draft vocabulary] per draft depth (row i's
        draft k: as the engine drafts it after the tokens up to i + k + 1), and the model's: its logits over the draft
        vocabulary and its top token (whole vocabulary) at every position, and each token's document index."""
        B, T = input_ids.shape
        with torch.no_grad():
            out = self.target(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                output_hidden_states=True,
                use_cache=False,
            )
            features = torch.cat([out.hidden_states[j] for j in self.aux], dim=-1)
            logits = out.logits
            greedy = logits.argmax(-1)  # the model's token after each position (its top one, whole vocabulary)
            teacher = logits[..., self.head.draft_tokens].float()
            embed = self.target.get_input_embeddings()
            embeddings = embed(torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1))
            index = torch.arange(T, device=input_ids.device)
            if position_ids is None:
                positions = index.expand(B, T)
                documents = torch.zeros_like(input_ids)
            else:  # packed documents: positions restart at each document's first token
                positions = position_ids
                documents = (position_ids == 0).long().cumsum(dim=1)
            causal = (index[None, :, None] >= index[None, None, :]) & (documents[:, :, None] == documents[:, None, :])
        drafts = self.head.unrolled(features, embeddings, positions, causal, self.steps)
        return drafts, teacher, greedy, documents

    def forward(self, input_ids, labels=None, attention_mask=None, position_ids=None, **_):
        from pylon.models import TokenLoss

        if labels is None:
            raise ValueError("Eagle3Trainer.forward needs labels (which tokens the drafts are taught)")
        B, T = input_ids.shape
        drafts, teacher, greedy, documents = self.drafts(input_ids, attention_mask, position_ids)
        loss_sum = torch.zeros((), device=input_ids.device, dtype=torch.float32)
        stats, tokens = [], 0
        for k, draft in enumerate(drafts):
            # draft k at row i guesses the token at i + k + 2: the model's distribution at i + k + 1
            ahead = k + 2
            counted = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)
            if ahead < T:
                counted[:, : T - ahead] = (labels[:, ahead:] != -100) & (documents[:, ahead:] == documents[:, :-ahead])
            loss = draft_loss(draft, teacher, k)
            loss_sum = loss_sum + (self.decay**k) * loss[counted].sum()
            guessed = self.head.draft_tokens[draft.argmax(-1)]
            right = (guessed == shifted(greedy, k + 1)) & counted
            stats += [float(right.sum()), float(counted.sum())]
            if k == 0:
                tokens = int(counted.sum())
        result = TokenLoss(loss_sum, tokens)
        result["stats"] = stats
        return result


def head_parameters(config) -> tuple[int, int]:
    """(parameters, those in a matmul per drafted token) of the head of `config` (`head_config`'s), counted on the meta
    device: what the planner adds to the frozen model's and trains."""
    with torch.device("meta"):
        head = Eagle3Head(config, torch.zeros(config.draft_vocab_size, dtype=torch.long))
    total = sum(p.numel() for p in head.parameters())
    matmul = sum(m.weight.numel() for m in head.modules() if isinstance(m, torch.nn.Linear))
    return total, matmul


def head_flops_per_token(matmul_params: int, hidden_size: int, seq_len: int, steps: int) -> float:
    """Model FLOPs the head's `steps` drafts trained cost a position: each 6 x its matmul weights (`matmul_params`,
    `head_parameters`'s; forward and backward) and one layer's attention over the row (12 x d_model x seq, PaLM's
    count). The frozen model's forward pass is a third of its trained token's (`pylon.models.flops_per_token`)."""
    return steps * (6.0 * matmul_params + 12.0 * hidden_size * seq_len)
