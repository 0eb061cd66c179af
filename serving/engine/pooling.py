"""What a classifier's outputs mean: the labels of a reward model's, a cross-encoder's or a classifier's logits, and
the function that turns them into the numbers a client reads, as vLLM's pooling models give them.

A classifier is a checkpoint whose config's `architectures` is a family's `*ForSequenceClassification` (the head
`score`: hidden -> num_labels, over the last token's final hidden state), or a causal LM served with
`engine.classifier_from_token` (a reranker trained to answer a token: its head made of those tokens' lm_head rows).
The engine computes each input's logits (`RequestOutput.embedding` of a pooled request); the HTTP layer reads them
through a `Classifier`:

- **/classify** and **/pooling** (`activation`): transformers' loss for the config's `problem_type` says what the
  logits are: "regression", the values themselves; "multi_label_classification", each label's sigmoid; otherwise
  ("single_label_classification" or unset) a softmax over the labels, or the sigmoid of a lone label's logit (vLLM's
  `PoolerClassify`). A request's `activation: false` gets the logits as they are (a reward model's raw reward).
- **/v1/score** and **/rerank** (`score_activation`): a cross-encoder's score of a pair, by its sentence-transformers
  activation where its config names one (`sentence_transformers.activation_fn`, or
  `sbert_ce_default_activation_function`: Sigmoid, Identity, Tanh or Softmax of `torch.nn.modules`), else as above.
- **label**: the label of the largest logit, from the config's `id2label` (transformers' "LABEL_<i>" where unnamed).

An activation this module does not know stops the engine at start with a PylonError naming the file and key.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Literal

from pylon.errors import PylonError

Activation = Literal["softmax", "sigmoid", "tanh", "none"]

# sentence-transformers' activation names (`torch.nn.modules.<module>.<Class>`) -> ours: the ones cross-encoders ship.
_NAMED = {"Sigmoid": "sigmoid", "Identity": "none", "Tanh": "tanh", "Softmax": "softmax"}


@dataclass(frozen=True)
class Classifier:
    """A classifier's labels and how its logits are read (plain data: it crosses the engine process's pipe)."""

    labels: tuple[str, ...]
    activation: Activation  # /classify's and /pooling's
    score_activation: Activation  # a pair's, for /v1/score and /rerank
    architecture: str = ""  # what it is, for messages ("Qwen2ForSequenceClassification", "causal LM scored by tokens")

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def apply(self, logits: list[float], activation: bool = True, *, score: bool = False) -> list[float]:
        """`logits` through the activation of /classify (or, `score`, of a pair's score); as they are without
        `activation`."""
        how = (self.score_activation if score else self.activation) if activation else "none"
        if how == "sigmoid":
            return [_sigmoid(x) for x in logits]
        if how == "tanh":
            return [math.tanh(x) for x in logits]
        if how == "softmax":
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            total = sum(exps)
            return [e / total for e in exps]
        return list(logits)

    def label(self, logits: list[float]) -> str:
        """The label of the largest logit (the first of equals)."""
        return self.labels[max(range(len(logits)), key=logits.__getitem__)]

    def describe(self) -> str:
        return f"{self.architecture}, {self.num_labels} label{'s' if self.num_labels != 1 else ''}"


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def read_classifier(model_dir: str, config, *, from_tokens: tuple[str, ...] = ()) -> Classifier:
    """The `Classifier` of the model in `model_dir` whose transformers config is `config`: its own head's labels and
    activations, or (`from_tokens`: engine.classifier_from_token) the one label of a head made of those tokens."""
    where = os.path.join(model_dir, "config.json")
    if from_tokens:
        return Classifier(
            ("yes" if len(from_tokens) == 2 else from_tokens[0],),
            "sigmoid",
            "sigmoid",
            f"{type(config).__name__.removesuffix('Config')} scored by {' vs '.join(reversed(from_tokens))}",
        )
    count = int(getattr(config, "num_labels", 0) or 0)
    id2label = getattr(config, "id2label", None) or {}
    labels = tuple(str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(count))
    if not labels:
        raise PylonError(f"{where}: num_labels: a classifier needs at least one label (got {count}); fix the config")
    problem = getattr(config, "problem_type", None)
    activation: Activation = (
        "none"
        if problem == "regression"
        else "sigmoid"
        if problem == "multi_label_classification" or len(labels) == 1
        else "softmax"
    )
    score_activation = activation
    named = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn") or getattr(
        config, "sbert_ce_default_activation_function", None
    )
    if named:
        short = str(named).rsplit(".", 1)[-1]
        if not str(named).startswith("torch.nn.modules.") or short not in _NAMED:
            raise PylonError(
                f"{where}: sentence_transformers.activation_fn: {named!r} is not one of torch.nn.modules' "
                f"{', '.join(_NAMED)}; the engine applies those only (fix the config or remove the key)"
            )
        score_activation = _NAMED[short]  # type: ignore[assignment]
    architecture = next(iter(getattr(config, "architectures", None) or ()), "classifier")
    return Classifier(labels, activation, score_activation, architecture)
