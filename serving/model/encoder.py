"""Encoders (families.ENCODER_MODEL_TYPES: BERT and its descendants, RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT,
ELECTRA, MPNet, DeBERTa-v2/v3, ModernBERT, NomicBERT, GTE, EuroBERT): a `*ForSequenceClassification` checkpoint (a
cross-encoder: ms-marco's MiniLM cross-encoders are BERT, BAAI's bge-reranker-base, -large and -v2-m3 XLM-RoBERTa,
mxbai-rerank-v1 DeBERTa-v3) served as a classifier (engine/pooling.py) for /classify, /pooling, /v1/score and /rerank;
any other checkpoint as an embedding model (bge-m3's dense vectors, all-MiniLM, all-mpnet, e5, gte-modernbert) for
/v1/embeddings, pooled as its sentence-transformers files say (`pooling_of`: the CLS token or the mean).

An encoder attends both ways over its whole input, so there is nothing to cache and nothing to chunk: each step's inputs
are read whole, right-padded into one batch through the loaded model (`transformers`' own forward, with its attention
mask and, for a BERT pair, its segments: 0 up to the first [SEP], 1 after), and each input's logits are its row of the
classifier's output, or its vector the pooled last hidden states. The engine keeps a prompt whole
(`Scheduler(whole_prompts=True)`), refuses one longer than a step's token budget, and shares no prefix cache.

bge-m3 is three models in one checkpoint: beside its dense vector (CLS pooling) it ships two token heads as PyTorch
files, `colbert_linear.pt` (hidden -> ColBERT dimension: a vector per token for late interaction) and
`sparse_linear.pt` (hidden -> 1: a lexical weight per token). Where they are, the runner loads them and a pooled
request may ask for its tokens' outputs instead (`SamplingParams.pool_task`, FlagEmbedding's formulas):
"multi_vector", each token's ColBERT vector but the first's (the CLS), L2-normalised; "token_weights", each token's
relu(sparse_linear(hidden)) (the HTTP layer keeps a token id's largest weight, leaving out the special tokens, as
FlagEmbedding's `lexical_weights` do).

`EncoderRunner` has the part of `ModelRunner`'s interface the engine calls for pooled requests.
"""

from __future__ import annotations

import torch

from pylon.errors import PylonError
from pylon.serving.model.runner import resolve_device, resolve_dtype, weights_failure
from pylon.serving.model.step import StepSequence


def pooling_of(model_dir: str) -> str:
    """How an encoder's embedding checkpoint pools its tokens into a vector, as its sentence-transformers files say
    (`modules.json` and the Pooling module's `config.json`): "cls" (BGE, bge-m3's dense vectors) or "mean"
    (all-MiniLM, e5); "cls" where the checkpoint ships no such files (BERT's own pooling token). A module past pooling
    that changes the vector (a Dense layer) is refused by name, since the engine would not apply it; Normalize is
    what /v1/embeddings does anyway."""
    import json
    import os

    modules_file = os.path.join(model_dir, "modules.json")
    if not os.path.exists(modules_file):
        return "cls"
    try:
        with open(modules_file) as f:
            modules = json.load(f)
        pooling = next(m for m in modules if m.get("type", "").endswith("Pooling"))
        with open(os.path.join(model_dir, pooling.get("path", ""), "config.json")) as f:
            settings = json.load(f)
    except (OSError, ValueError, StopIteration, AttributeError) as e:
        raise PylonError(
            f"model {model_dir}: modules.json names no readable Pooling module ({type(e).__name__}); fix the "
            "sentence-transformers files or remove them"
        ) from None
    extra = [
        m.get("type") for m in modules if not str(m.get("type", "")).endswith(("Transformer", "Pooling", "Normalize"))
    ]
    if extra:
        raise PylonError(f"model {model_dir}: modules.json has {extra[0]}, which the engine does not apply")
    if settings.get("pooling_mode_cls_token"):
        return "cls"
    if settings.get("pooling_mode_mean_tokens"):
        return "mean"
    raise PylonError(
        f"model {model_dir}: its Pooling module pools by {[k for k, v in settings.items() if v is True]}; the engine "
        "pools by the CLS token or the mean"
    )


def _position_offset(model) -> int:
    """How many rows of a model's learned position table come before its first token's: RoBERTa's, XLM-RoBERTa's,
    CamemBERT's and MPNet's positions start after their padding index (514 rows are 512 tokens); BERT's start at 0,
    and a model with rotary positions (ModernBERT, NomicBERT, GTE) has no table."""
    for name, module in model.named_modules():
        if name.endswith("position_embeddings") and isinstance(module, torch.nn.Embedding):
            return 0 if module.padding_idx is None else module.padding_idx + 1
    return 0


TOKEN_HEADS = {"multi_vector": "colbert_linear.pt", "token_weights": "sparse_linear.pt"}  # bge-m3's files


def _token_heads(model_dir: str, hidden: int) -> dict[str, torch.nn.Linear]:
    """The token heads a checkpoint ships (TOKEN_HEADS), by pool task: each file a Linear's state dict over the
    encoder's hidden size (read as tensors only: a .pt file runs no code here)."""
    import os

    heads = {}
    for task, name in TOKEN_HEADS.items():
        path = os.path.join(model_dir, name)
        if not os.path.exists(path):
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            weight, bias = state["weight"], state.get("bias")
            if weight.dim() != 2 or weight.shape[1] != hidden or (task == "token_weights" and weight.shape[0] != 1):
                raise ValueError(f"a weight of {tuple(weight.shape)}")
        except Exception as e:
            raise PylonError(
                f"model {model_dir}: {name} is not a linear layer over the encoder's {hidden} hidden features "
                f"({type(e).__name__}: {str(e)[:200]}); fix or remove the file"
            ) from None
        head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        head.load_state_dict(state)
        heads[task] = head
    return heads


class EncoderRunner:
    recurrent = False
    vision = None

    def __init__(self, model_dir: str, *, device: str = "auto", dtype: str = "auto", sep_token_id: int | None = None):
        """`sep_token_id`: the tokenizer's [SEP], where a BERT pair's second segment starts after."""
        from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

        from pylon.serving.model.families import is_sequence_classifier

        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.config = self.full_config = config
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        # A cross-encoder's logits, or an embedding model's pooled vector (`pooling_of`: CLS or mean)
        self.pooling = None if is_sequence_classifier(config) else pooling_of(model_dir)
        try:
            if self.pooling is None:
                self.model = AutoModelForSequenceClassification.from_pretrained(
                    model_dir, dtype=self.dtype, local_files_only=True
                )
            else:
                self.model = AutoModel.from_pretrained(model_dir, dtype=self.dtype, local_files_only=True)
        except Exception as e:
            raise PylonError(weights_failure(model_dir, e)) from e
        self.model.to(self.device).eval()
        # An embedding model's token heads (bge-m3's ColBERT and sparse ones), by pool task
        self.heads = {} if self.pooling is None else _token_heads(model_dir, config.hidden_size)
        for head in self.heads.values():
            head.to(self.device, self.dtype).eval()
        self.pool_tasks = tuple(sorted(self.heads))
        # (the engine reads a runner with a classifier as one)
        self.classifier = self.model if self.pooling is None else None
        self.vocab_size = config.vocab_size
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else 0
        self.max_position_embeddings = config.max_position_embeddings - _position_offset(self.model)
        # BERT's segments (0 up to the first [SEP], 1 after) where the model has them and its tokenizer gives them
        # (a CamemBERT checkpoint may have two and its tokenizer none: transformers then reads all 0)
        self.segments = (getattr(config, "type_vocab_size", 1) or 1) > 1 and sep_token_id is not None
        self.sep_token_id = sep_token_id

    def warm_up(self, max_num_seqs: int, max_num_batched_tokens: int, max_gflop: float = 0.0) -> tuple[int, int]:
        return 0, 0

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> int:
        return 0

    def release_state(self, key: str) -> None:
        pass

    @torch.no_grad()
    def execute_step(self, steps: list[StepSequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """No logits, and each sequence's classifier logits `[sequences, labels]` (float32), in order: every sequence
        is a whole input (`start` 0, `samples`, `pooled`)."""
        for s in steps:
            if s.start or not s.samples or not s.pooled:
                raise ValueError("EncoderRunner: every sequence of a step is a whole input to pool")
        width = max(s.num_new_tokens for s in steps)
        ids = torch.full((len(steps), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(steps), width), dtype=torch.long)
        types = torch.zeros((len(steps), width), dtype=torch.long)
        for row, s in enumerate(steps):
            n = s.num_new_tokens
            ids[row, :n] = torch.tensor(s.token_ids)
            mask[row, :n] = 1
            if self.segments and self.sep_token_id in s.token_ids[:-1]:
                types[row, s.token_ids.index(self.sep_token_id) + 1 : n] = 1
        inputs = {"input_ids": ids.to(self.device), "attention_mask": mask.to(self.device)}
        if self.segments:
            inputs["token_type_ids"] = types.to(self.device)
        if self.pooling is None:
            return torch.empty(0, self.vocab_size, device=self.device), self.model(**inputs).logits.float()
        hidden = self.model(**inputs).last_hidden_state
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        else:  # the mean over each input's own tokens (its mask), as sentence-transformers' Pooling computes it
            weights = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        none = torch.empty(0, self.vocab_size, device=self.device)
        if not any(s.pool_task for s in steps):
            return none, pooled.float()
        # Some want their tokens' outputs: one tensor per sequence, of its own length
        rows = []
        for row, s in enumerate(steps):
            if s.pool_task == "multi_vector":  # every token's but the CLS's, normalised (FlagEmbedding's colbert_vecs)
                vectors = self.heads[s.pool_task](hidden[row, 1 : s.num_new_tokens]).float()
                rows.append(torch.nn.functional.normalize(vectors, dim=-1))
            elif s.pool_task == "token_weights":  # every token's relu(sparse_linear(hidden))
                rows.append(torch.relu(self.heads[s.pool_task](hidden[row, : s.num_new_tokens])).float()[:, 0])
            else:
                rows.append(pooled[row].float())
        return none, rows
