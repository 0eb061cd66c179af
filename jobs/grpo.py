"""Group relative policy optimisation (`TrainJobSpec.objective: grpo`; Shao et al. 2024, TRL's `GRPOTrainer`): the
model learns from completions it samples itself, each scored by reward functions, with no value model.

The data is prompts (`pylon data prepare --prompts`), or a prompt-completion or chat dataset: each document a prompt
(its tokens before its last counted run) and an answer (that run up to its eos: the record's answer or completion, or
the last assistant reply), which the reward functions compare completions with (`prompts_and_answers`). Each
micro-batch, in code order:

1. **Sample** (`sample_completions`): every prompt of the micro-batch's rows `generations` times (G), with the model
   as it is now, in eval mode, a KV cache, `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty`
   (`sampling_probs`), up to `max_completion_tokens` or an eos; at
   ZeRO-3 from the model gathered once (`sampling_model`). The random draws come from a generator seeded by (data
   seed, step, micro-batch, rank), so a resumed run samples what the uninterrupted run did.
2. **Score** (`Rewards`): each completion's reward, the weighted sum of the reward functions' (and reward models')
   scores (a function's None counts as no score, as TRL's NaN).
3. **Advantages** (`group_advantages`): A = (r - mean of its group) / (std of its group + 1e-4), or the micro-batch's
   std (`scale_rewards: batch`), or no division (`none`, Dr. GRPO). Steps 1-3 make a `Rollout` (`grpo_sample`).
4. **Loss** (`grpo_losses`, run by `grpo_train`) on the prompt and completion as one sequence, over the completion's
   tokens (its eos included): per token, with r = exp(log pi - log pi_old) the ratio to the sampling policy,
   -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta KL, KL = exp(ref - log pi) - (ref - log pi) - 1,
   every log-probability the tempered distribution's (the logits divided by `temperature`, as TRL's)
   (Schulman's k3, against the model as it started: with lora its adapters disabled, else a frozen copy; only with
   beta > 0). Trained on once (`iterations` 1, TRL's default), pi is the sampling policy: r is 1, its gradient
   A grad log pi, and nothing is clipped. With `iterations` mu, a `Rollout` is kept and trained on at mu steps, the
   later ones' ratios against its sampling log-probabilities. Averaged (`loss`): dapo over every completion token of
   the micro-batch on every rank; grpo per completion, then over completions; dr_grpo each completion's sum over
   max_completion_tokens, then over completions.

`objective: rloo` (REINFORCE leave-one-out; Ahmadian et al. 2024, TRL's `RLOOTrainer`) runs the same steps 1-2, then:
the sampling policy's log-probabilities and, with beta > 0, the reference's (passes without gradients, at sampling);
each completion's reward less beta x its KL to the start (the sum over its tokens of log pi_old - ref, TRL's);
advantages against the leave-one-out baseline (`leave_one_out_advantages`: r less the mean of its group's other
completions), standardised over the micro-batch with `normalize_advantages`; and the loss per completion
(`rloo_losses`): with r = exp(its tokens' summed log pi - the same under the sampling policy), -min(r A, clip(r) A),
averaged over completions. No KL term in the loss: it is in the reward.

Logged per step (TRL's figures, under `grpo_`): the mean reward and each function's (`grpo_rewards.<function>`), the
mean of the groups' reward std, the share of groups whose completions all scored alike (no signal), the completions'
mean length and the share clipped at max_completion_tokens, the KL (beta > 0), the share of tokens whose ratio was
clipped, and the seconds spent sampling. A held-out evaluation (`GrpoEvaluation`) adds each held-out prompt's greedy
completion's mean reward (`val_grpo_reward`) to the loss of the dataset's own completions.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import math
import re
import time
from dataclasses import dataclass, field

import numpy as np

from pylon.data.shards import PROMPT_MESSAGES, DataError, split_words
from pylon.errors import PylonError

# ---------------------------------------------------------------------------------------------------------
# Built-in reward functions: a completion against its record's answer
# ---------------------------------------------------------------------------------------------------------


def completion_text(completion) -> str:
    """A completion's text: itself, or a conversational completion's (TRL's `[{"role": "assistant", "content":
    ...}]`, what the reward functions get where the prompt was a list of messages) last message's content."""
    if isinstance(completion, str):
        return completion
    return str(completion[-1].get("content") or "") if completion else ""


def exact_match(completions: list, answers: list[str], **_) -> list[float]:
    """1.0 where the completion is the answer, surrounding whitespace aside; else 0.0."""
    return [float(completion_text(c).strip() == a.strip()) for c, a in zip(completions, answers)]


def contains_answer(completions: list, answers: list[str], **_) -> list[float]:
    """1.0 where the answer (stripped; not empty) occurs in the completion; else 0.0."""
    return [float(bool(a.strip()) and a.strip() in completion_text(c)) for c, a in zip(completions, answers)]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _last_number(text: str) -> float | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def last_number_match(completions: list, answers: list[str], **_) -> list[float | None]:
    """GSM8K's rule: 1.0 where the completion's last number equals the answer's last number; 0.0 where it does not
    or has none; None (no score) where the answer has no number."""
    out: list[float | None] = []
    for c, a in zip(completions, answers):
        want = _last_number(a)
        out.append(None if want is None else float(_last_number(completion_text(c)) == want))
    return out


BUILT_IN_REWARDS = {f.__name__: f for f in (exact_match, contains_answer, last_number_match)}


class Rewards:
    """The reward functions of `grpo.rewards`, resolved: built-in names, `package.module:function` imported here,
    or reward models (`RewardModel`). A function that cannot be imported, raises, or returns other than one number
    (or None) per completion is a PylonError naming it by its field (`grpo.rewards[i].function`)."""

    def __init__(self, specs, record_fields: list[str] | tuple[str, ...] = (), judge: str | None = None) -> None:
        # the dataset's record fields (`ShardManifest.record_fields`): passed to every function by name
        self.record_fields = tuple(record_fields)
        self.functions, self.names, self.weights, self.fields = [], [], [], []
        for i, spec in enumerate(specs):
            field = f"grpo.rewards[{i}]." + ("function" if spec.function is not None else "model")
            if spec.model is not None:
                self.functions.append(RewardModel(spec.model, field))
            else:
                self.functions.append(_resolve(spec.function, field))
            self.names.append(spec.short_name)
            self.weights.append(float(spec.weight))
            self.fields.append(f"{field} ({spec.function if spec.function is not None else _shown(spec.model)})")
        if judge is not None:  # objective online_dpo's pairwise judge, in the rewards' place (`PairwiseJudge`)
            self.functions.append(PairwiseJudge(judge, f"grpo.judge ({judge})"))
            self.names.append(judge.rsplit(":", 1)[-1])
            self.weights.append(1.0)
            self.fields.append(f"grpo.judge ({judge})")

    @property
    def judged(self) -> bool:
        """Whether a pairwise judge scores (objective online_dpo's `grpo.judge`): pairs, never one completion alone."""
        return any(isinstance(fn, PairwiseJudge) for fn in self.functions)

    @classmethod
    def of(cls, grpo, record_fields: list[str] | tuple[str, ...] = ()) -> "Rewards":
        """The rewards (or the judge) of `grpo` (a GrpoSpec)."""
        return cls(grpo.rewards, record_fields, judge=grpo.judge)

    def to(self, device) -> "Rewards":
        """Score with the reward models on `device` (the worker's)."""
        for fn in self.functions:
            if isinstance(fn, RewardModel):
                fn.device = device
        return self

    def scores(self, prompts: list, completions: list, answers: list[str], completion_ids, fields=None) -> np.ndarray:
        """[completions, functions] float64, NaN where a function gave None. `fields`: the record fields' values, a
        list per name (one value per completion, None where its record had none), passed by name as TRL passes a
        dataset's other columns. A prompt is text or a list of messages, its completion then text or TRL's
        conversational one (`completion_text`)."""
        out = np.full((len(completions), len(self.functions)), np.nan)
        fields = fields or {}
        for j, (fn, where) in enumerate(zip(self.functions, self.fields)):
            try:
                got = fn(
                    prompts=prompts, completions=completions, answers=answers, completion_ids=completion_ids, **fields
                )
            except PylonError:  # (a judge's verdict it cannot read: named already)
                raise
            except Exception as e:  # noqa: BLE001 - a user's function: say which one failed
                unexpected = re.search(r"unexpected keyword argument '([^']+)'", str(e))
                hint = (
                    f"; the dataset's record fields ({', '.join(fields)}) are passed by name: take them, or **kwargs"
                    if isinstance(e, TypeError) and unexpected and unexpected.group(1) in fields
                    else ""
                )
                raise PylonError(f"{where} raised {type(e).__name__}: {e}{hint}") from e
            got = _one_each(
                got, len(completions), where, "scores for", "completions; return one number (or None) per completion"
            )
            for i, v in enumerate(got):
                if v is None:
                    continue
                if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(float(v)):
                    raise PylonError(f"{where} scored completion {i} {v!r}; a score is a finite number or None")
                out[i, j] = float(v)
        return out

    def score_completions(self, pairs, completions, tokenizer, eos_id: int) -> np.ndarray:
        """`scores` of token ids: `pairs` (prompt, answer, record fields: `prompts_and_answers`) each sampled
        len(completions) / len(pairs) times, the copies of a prompt consecutive; decoded by `tokenizer`, each
        completion without its eos; with every one of `record_fields`, None where a record lacks it. As TRL's: a
        prompt given as messages (its record's `PROMPT_MESSAGES`) is passed as those messages, and its completions
        as `[{"role": "assistant", "content": text}]`; any other prompt as the text it decodes to (a chat prompt as
        its template rendered it), and its completions as text."""
        copies = len(completions) // max(len(pairs), 1)
        prompts = []
        for p, _, record in pairs:
            messages = record.get(PROMPT_MESSAGES)
            prompts += [messages if isinstance(messages, list) else tokenizer.decode(p)] * copies
        texts = [tokenizer.decode(_without_eos(c, eos_id)) for c in completions]
        return self.scores(
            prompts,
            [[{"role": "assistant", "content": t}] if isinstance(p, list) else t for p, t in zip(prompts, texts)],
            [tokenizer.decode(a) for _, a, _ in pairs for _ in range(copies)],
            [c.tolist() for c in completions],
            {name: [r.get(name) for _, _, r in pairs for _ in range(copies)] for name in self.record_fields},
        )

    @staticmethod
    def sums(scores: np.ndarray) -> list[float]:
        """Each function's score sum, then each one's count of scores (its None left out): a step's figures."""
        k = scores.shape[1]
        return [
            *(float(np.nansum(scores[:, j])) for j in range(k)),
            *(float((~np.isnan(scores[:, j])).sum()) for j in range(k)),
        ]

    def total(self, scores: np.ndarray) -> np.ndarray:
        """Each completion's reward: the weighted sum of its scores, a missing score counting 0 (TRL's nansum)."""
        return np.nansum(scores * np.asarray(self.weights)[None, :], axis=1)


class RewardModel:
    """A reward model as a reward function: an `objective: reward` export (a `*ForSequenceClassification` with one
    label), scoring each prompt and completion as one text, tokenized as `/classify` tokenizes text (the tokenizer's
    special tokens added) and read at its last token; a conversational prompt (a list of messages) with its
    completion as the assistant's reply, rendered by the reward model's own chat template as a conversational
    preference pair is for its training (and `/classify` with `messages`), as TRL scores one. The config is checked
    when made (the driver, before workers start); the weights load on first use, whole, in fp32, on `device`."""

    def __init__(self, uri: str, where: str) -> None:
        from transformers import AutoConfig

        from pylon.models import is_classifier, local_model_dir

        self.uri, self.where, self.device = uri, where, None
        self._model = self._tok = None
        try:
            with local_model_dir(uri, weights=False) as d:
                config = AutoConfig.from_pretrained(d)
        except Exception as e:  # noqa: BLE001 - unreadable or not a model directory: the same remedy
            raise PylonError(f"{where}: {_shown(uri)} is not a model directory ({type(e).__name__})") from None
        if not is_classifier(config) or config.num_labels != 1:
            architectures = getattr(config, "architectures", None)
            raise PylonError(
                f"{where}: {_shown(uri)} is not a reward model (architectures {architectures}, {config.num_labels} "
                "labels); give the export of an `objective: reward` run"
            )

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        from pylon.data.tokenizer import load_tokenizer
        from pylon.models import local_model_dir

        with local_model_dir(self.uri) as d:
            model = AutoModelForSequenceClassification.from_pretrained(d, dtype=torch.float32)
            self._tok = load_tokenizer(d)
        self._model = model.eval().requires_grad_(False).to(self.device or "cpu")

    def has_chat_template(self) -> bool:
        """Whether its tokenizer can render conversations (`check_rewards`, on the driver, for a dataset with prompts
        given as messages only): its files read once more, without the weights."""
        from pylon.data.tokenizer import load_tokenizer
        from pylon.models import local_model_dir

        try:
            with local_model_dir(self.uri, weights=False) as d:
                return bool(getattr(load_tokenizer(d), "has_chat_template", False))
        except Exception:  # noqa: BLE001 - no tokenizer: none to render with (the weights' load says so, on first use)
            return False

    def _encode(self, prompt, completion) -> np.ndarray:
        if isinstance(prompt, list):  # messages, then the completion as the assistant's reply
            reply = completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            return self._tok.encode_chat([*prompt, *reply], self.where)[-1][0]
        return self._tok.encode(prompt + completion_text(completion), special=True)

    def __call__(self, prompts: list, completions: list, **_) -> list[float]:
        import torch

        from pylon.models import head_outputs

        if self._model is None:
            self._load()
        rows = [self._encode(p, c) for p, c in zip(prompts, completions)]
        width = max((len(r) for r in rows), default=1)
        ids = torch.full((len(rows), width), self._tok.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.as_tensor(np.asarray(r, dtype=np.int64))
            mask[i, : len(r)] = 1
        device = next(self._model.parameters()).device
        with torch.no_grad(), head_outputs(self._model) as heads:
            self._model(input_ids=ids.to(device), attention_mask=mask.to(device))
        last = torch.as_tensor([max(len(r), 1) - 1 for r in rows], device=device)
        return heads[-1][torch.arange(len(rows), device=device), last, 0].float().tolist()


class PairwiseJudge:
    """objective online_dpo's `grpo.judge` (TRL's pairwise judges: `BasePairwiseJudge.judge(prompts, completions)`)
    as a reward function of a micro-batch's pairs (each prompt's two completions, consecutive): called with one
    prompt a pair (text, or its messages as the reward functions get them) and the pairs' completions as text,
    [[a, b], ...]; its verdict for each, the index of the preferred completion, scores it 1.0 and the other 0.0, so
    that `pair_preferences` prefers it; -1 or None scores neither (a tie: the pair is left out). A function, or an
    object with a `judge` method (an instance of a TRL-style judge class)."""

    def __init__(self, path: str, where: str) -> None:
        target = _imported(path, where)
        method = getattr(target, "judge", None)
        self.judge = method if callable(method) else target
        if not callable(self.judge):
            raise PylonError(f"{where}: {path} is neither a function nor an object with a judge method")
        self.where = where

    def __call__(self, prompts: list, completions: list, **_) -> list[float | None]:
        if len(completions) % 2:
            raise PylonError(f"{self.where}: {len(completions)} completions do not make pairs (grpo.generations: 2)")
        pairs = [[completion_text(a), completion_text(b)] for a, b in zip(completions[::2], completions[1::2])]
        verdicts = _one_each(
            self.judge(prompts[::2], pairs),
            len(pairs),
            self.where,
            "verdicts for",
            "pairs; return one a pair: 0 (the first preferred), 1 (the second), -1 or None (neither)",
        )
        out: list[float | None] = []
        for i, v in enumerate(verdicts):
            if v is None or (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v == -1):
                out += [None, None]
            elif isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v in (0, 1):
                out += [1.0, 0.0] if v == 0 else [0.0, 1.0]
            else:
                raise PylonError(
                    f"{self.where} judged pair {i} {v!r}; a verdict is 0 (the first completion preferred), 1 (the "
                    "second), or -1 or None (neither)"
                )
        return out


def _one_each(got, n: int, where: str, what: str, remedy: str) -> list:
    """A user's function's result as a list of `n` (one a completion, or a pair); else a PylonError naming `where`:
    "{where} returned 3 {what} 4 {remedy}"."""
    try:
        out = list(got)
    except TypeError:
        out = None
    if out is None or len(out) != n:
        raise PylonError(f"{where} returned {type(got).__name__ if out is None else len(out)} {what} {n} {remedy}")
    return out


def _shown(uri: str) -> str:
    """`uri` for messages: a local path as given, a URI without credentials (`storage.describe`)."""
    from pylon import storage

    return storage.describe(uri) if "://" in uri else uri


def _resolve(name: str, where: str):
    if name in BUILT_IN_REWARDS:
        return BUILT_IN_REWARDS[name]
    fn = _imported(name, where)
    if not callable(fn):
        raise PylonError(f"{where}: {name.partition(':')[0]} has no function {name.partition(':')[2]}")
    return fn


def _imported(name: str, where: str):
    """What `package.module:name` names, imported here; a PylonError naming `where` when it cannot be."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure has the same remedy
        raise PylonError(
            f"{where}: cannot import {module_name} ({type(e).__name__}: {e}); ship it in the job's working directory "
            "(`ray job submit --working-dir`, `pylon train` from that directory) or install it on the cluster"
        ) from e
    if not hasattr(module, attr):
        raise PylonError(f"{where}: {module_name} has no function {attr}")
    return getattr(module, attr)


# What every reward function is passed already: a record field may not take one of these names
REWARD_ARGUMENTS = ("prompts", "completions", "answers", "completion_ids")


def check_rewards(spec, manifest) -> None:
    """Resolve every reward function of `spec` (a TrainJobSpec with objective grpo or rloo) here, before workers
    start; and check that its dataset's record fields (`manifest`'s) can be passed beside the arguments every
    function takes."""
    clash = [name for name in manifest.record_fields if name in REWARD_ARGUMENTS]
    if clash:
        raise PylonError(
            f"data.uri {spec.data.uri}: its records' field {clash[0]!r} would be passed to the reward functions by "
            f"name, and {clash[0]} is what they are passed already ({', '.join(REWARD_ARGUMENTS)}); rename it in the "
            "source records and prepare them again"
        )
    rewards = Rewards.of(spec.grpo, manifest.record_fields)
    if manifest.prompt_format in ("conversational", "mixed"):
        for fn, where in zip(rewards.functions, rewards.fields):
            if isinstance(fn, RewardModel) and not fn.has_chat_template():
                raise PylonError(
                    f"{where}: its tokenizer has no chat template, and data.uri {spec.data.uri} holds prompts given "
                    "as messages, which a reward model scores as the conversation its own template renders (TRL's); "
                    "give the reward model's directory a chat template (`pylon data chat-template`), or prepare the "
                    "prompts as text"
                )


# ---------------------------------------------------------------------------------------------------------
# The settings
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GrpoLoss:
    """objective grpo's settings (`TrainJobSpec.grpo`), and whether the model computes its output layer in chunks."""

    generations: int = 8
    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    beta: float = 0.0
    kind: str = "dapo"
    scale: str = "group"
    chunked: bool = False
    gather: bool = True  # at ZeRO-3, the whole model gathered once for sampling (`zero3_gather_for_sampling`)
    iterations: int = 1  # updates on each sampled micro-batch (TRL's num_iterations)
    epsilon: float = 0.2  # the clip below 1 of the policy ratio
    epsilon_high: float = 0.2  # and above (DAPO's clip-higher: larger); loss cispo: the importance weight's bound
    delta: float | None = None  # two-sided clipping (INTELLECT-2, TRL's delta): the unclipped ratio's bound
    mask_truncated: bool = False  # completions cut without an eos left out of the loss (`mask_truncated_completions`)
    normalize: bool = False  # objective rloo: advantages standardised over the micro-batch (`normalize_advantages`)
    log_completions: int = 0  # completions a micro-batch keeps as `Rollout.samples` (`log_completions`)
    sequence_ratio: bool = False  # GSPO: one policy ratio a completion (`importance_sampling_level: sequence`)
    # grpo.sampler engine or server, objectives grpo and rloo: the importance-sampling correction of the engine's
    # sampling (`sampler_correction`: sequence_mask, sequence_truncate, token_mask, token_truncate; none) and the
    # bounds of its ratio of the trained model's probability to the engine's (`sampler_correction_min`,
    # `sampler_correction_cap`)
    correction: str = "none"
    correction_min: float | None = None
    correction_max: float | None = None

    @classmethod
    def of(cls, spec) -> "GrpoLoss":
        g = spec.grpo
        return cls(
            generations=g.generations,
            max_tokens=g.max_completion_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k or 0,
            min_p=g.min_p or 0.0,
            repetition_penalty=g.repetition_penalty,
            beta=spec.dpo_beta if spec.objective == "online_dpo" else g.beta,
            kind=spec.objective if spec.objective in ("rloo", "online_dpo") else g.loss,
            scale=g.scale_rewards,
            normalize=g.normalize_advantages,
            chunked=spec.loss_chunk_tokens > 0,
            gather=g.zero3_gather_for_sampling,
            iterations=g.iterations,
            epsilon=g.epsilon,
            epsilon_high=g.epsilon if g.epsilon_high is None else g.epsilon_high,
            delta=g.delta,
            mask_truncated=g.mask_truncated_completions,
            log_completions=g.log_completions,
            sequence_ratio=g.importance_sampling_level == "sequence",
            correction=g.sampler_correction if g.sampler != "model" and spec.objective in ("grpo", "rloo") else "none",
            correction_min=g.sampler_correction_min,
            correction_max=g.sampler_correction_cap,
        )

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0  # (online_dpo's beta is dpo_beta's, > 0: its reference is DPO's)

    @property
    def online_dpo(self) -> bool:
        return self.kind == "online_dpo"

    @property
    def rloo(self) -> bool:
        return self.kind == "rloo"

    @property
    def sampling_logprobs(self) -> bool:
        """Whether sampling also takes the sampling policy's log-probabilities (a pass without gradients): for later
        updates' ratios (iterations > 1), rloo's KL in the reward, and the engine sampler's correction."""
        return self.iterations > 1 or (self.rloo and self.needs_reference) or self.corrects

    @property
    def corrects(self) -> bool:
        """Whether the engine sampler's importance-sampling correction weighs the loss (`correction_weights`)."""
        return self.correction != "none"


# ---------------------------------------------------------------------------------------------------------
# 0. Prompts and answers from a micro-batch's rows
# ---------------------------------------------------------------------------------------------------------


def prompts_and_answers(batch, eos_id: int, whole: bool = False) -> list[tuple[np.ndarray, np.ndarray, dict]]:
    """Every document of `batch`'s rows (a `pylon.data.reader.Batch` of a prompt-completion or chat dataset) as (its
    prompt's token ids, its answer's, its record's other fields): the answer the document's last run of counted
    tokens up to its first eos (the eos prepare appends, or a chat template's end of turn when that is the eos), the
    prompt every token before that run (a chat's ends with the template's generation prompt). A document with no
    counted token is all prompt, its answer empty. The fields (`Batch.records`; {} when its record had none, or the
    dataset has none) go to the reward functions by name (`Rewards.score_completions`); a row's first tokens that
    continue a document begun in the row before (wrapped packing) have none. `whole` (objective kto's completions):
    the answer is the whole last run of counted tokens, its eos included, and a document with an empty prompt is
    kept, so that there is one entry per document, in row order."""
    ids, context, starts = split_words(batch.tokens, loss_mask=batch.loss_mask, eos_id=eos_id)
    if context is None:
        raise PylonError(
            "objective grpo reads prompts from a prompts, prompt-completion or chat dataset (`pylon data prepare "
            "--prompts`, `--prompt-completion` or `--chat`); this one is plain text, with no prompt to sample from"
        )
    out = []
    for row in range(len(batch)):
        n = int(batch.num_tokens[row])
        cuts = [0, *np.flatnonzero(starts[row, 1:n]) + 1, n]
        held = batch.records[row] if batch.records is not None else []  # ([]: none of its documents had fields)
        if held and len(held) != int(starts[row, :n].sum()):
            raise DataError(
                f"row {int(batch.sample_ids[row])}: {int(starts[row, :n].sum())} documents start in it, its records "
                f"file line holds {len(held)}: the records do not belong to these shards; prepare the dataset again"
            )
        records = iter(held)
        for a, b in zip(cuts[:-1], cuts[1:]):
            record = (next(records, None) if starts[row, a] else None) or {}
            counted = ~context[row, a:b]
            if not counted.any():
                out.append((ids[row, a:b].copy(), ids[row, b:b].copy(), record))
                continue
            last = int(np.flatnonzero(counted)[-1])
            first = last
            while first > 0 and counted[first - 1]:
                first -= 1
            answer = ids[row, a + first : a + last + 1]
            ends = np.flatnonzero(answer == eos_id)
            if len(ends) and not whole:  # (a chat template's end of turn, when it is the eos, and what follows it)
                answer = answer[: ends[0]]
            out.append((ids[row, a : a + first].copy(), answer.copy(), record))
    return [(p, ans, record) for p, ans, record in out if len(p) or whole]


# ---------------------------------------------------------------------------------------------------------
# 1. Sampling
# ---------------------------------------------------------------------------------------------------------


def sample_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """The generator seed of one micro-batch's sampling: the same on a resumed run as on the uninterrupted one."""
    return int.from_bytes(hashlib.sha256(f"grpo/{seed}/{step}/{micro}/{rank}".encode()).digest()[:8], "little") >> 1


@contextlib.contextmanager
def _eval_mode(module):
    training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(training)


def sample_completions(
    module,
    prompts: list[np.ndarray],
    loss: GrpoLoss,
    *,
    eos_id: int,
    pad_id: int,
    device,
    seed: int,
    greedy: bool = False,
    copies: int | None = None,
    synced: bool = False,
) -> list[np.ndarray]:
    """`copies` (default `loss.generations`) completions of each prompt, the copies of a prompt consecutive: each up
    to and including its eos, or `loss.max_tokens` tokens without one. Left-padded prompts, one forward pass over
    them, then one per token with the KV cache. `greedy`: the likeliest token (an evaluation's). `synced` (ZeRO-3 on
    several ranks, whose forward passes gather parameters collectively): every rank takes the same number of steps,
    stopping when no rank has a completion left to finish."""
    import torch
    import torch.distributed as dist

    copies = loss.generations if copies is None else copies
    rows = [p for p in prompts for _ in range(copies)]
    width = max((len(p) for p in rows), default=1)
    n = max(len(rows), 1)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, width - len(p) :] = torch.from_numpy(np.asarray(p, dtype=np.int64))
        mask[i, width - len(p) :] = 1
    if not rows:  # a rank whose data ran out: one row of padding, so that a synced forward pass still runs here
        mask[0, -1] = 1
    ids, mask = ids.to(device), mask.to(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    seen = None  # repetition_penalty: which tokens each row holds so far (its prompt's, then its completion's)
    out_tokens = torch.full((n, loss.max_tokens), pad_id, dtype=torch.long, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    if not rows:
        done[:] = True
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with _eval_mode(module), torch.no_grad():
        out = module(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        cache, next_pos = out.past_key_values, positions[:, -1:] + 1
        for t in range(loss.max_tokens):
            logits = out.logits[:, -1].float()
            if greedy:
                token = logits.argmax(-1)
            else:
                if loss.repetition_penalty != 1.0:
                    if seen is None:
                        seen = torch.zeros(logits.shape, dtype=torch.bool, device=device)
                        seen.scatter_(1, ids, mask.bool())  # (a left pad's id marks nothing: its mask is 0)
                    logits = _penalize_repeats(logits, seen, loss.repetition_penalty)
                probs = sampling_probs(logits, loss)
                token = torch.multinomial(probs, 1, generator=generator)[:, 0]
            token = torch.where(done, torch.full_like(token, pad_id), token)
            if seen is not None:
                seen[torch.arange(n, device=device), token] |= ~done
            out_tokens[:, t] = token
            done = done | (token == eos_id)
            left = (~done).any()
            if synced and dist.is_initialized():
                flag = left.to(torch.float32).reshape(1)
                dist.all_reduce(flag)
                left = flag.item() > 0
            if not bool(left) or t == loss.max_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=device)], dim=1)
            out = module(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            cache, next_pos = out.past_key_values, next_pos + 1
    completions = []
    for i in range(len(rows)):
        row = out_tokens[i].tolist()
        end = row.index(eos_id) + 1 if eos_id in row else loss.max_tokens
        completions.append(np.asarray(row[:end], dtype=np.int64))
    return completions


@contextlib.contextmanager
def sampling_model(engine, loss: GrpoLoss, synced: bool):
    """The module to sample with, and whether its ranks must decode in step. At ZeRO-3 with `loss.gather`, the whole
    model gathered once and DeepSpeed's per-layer hooks lifted while it samples (DeepSpeed's
    `unwrap_model_for_generation`, as TRL samples): no collective per token, so each rank stops when its own
    completions end; else `engine.module` as it is, in step with the other ranks when `synced`."""
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else 0
    if stage == 3 and loss.gather:
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(engine):
            yield engine.module, False
    else:
        yield getattr(engine, "module", engine), synced


def _penalize_repeats(logits, seen, penalty: float):
    """CTRL's repetition penalty as transformers applies it (`RepetitionPenaltyLogitsProcessor`): a token already in
    the row's prompt or completion has its logit divided by `penalty` where positive, multiplied where negative."""
    import torch

    return torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)


def sampling_probs(logits, loss: GrpoLoss):
    """The distribution a completion's next token is drawn from, in transformers' order: the logits divided by
    `temperature`; kept to the `top_k` likeliest tokens, to the nucleus of `top_p`, and to the tokens at least `min_p`
    times as likely as the likeliest (each off at its default). The loss's log-probabilities are the tempered
    distribution's, untruncated (TRL's)."""
    import torch

    logits = logits / loss.temperature
    if loss.top_k and loss.top_k < logits.shape[-1]:
        kth = torch.topk(logits, loss.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = _nucleus(logits, loss.top_p)
    if loss.min_p:
        probs = probs.masked_fill(probs < loss.min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _nucleus(logits, top_p: float):
    """Sampling probabilities kept to the smallest set of tokens whose probability reaches `top_p`."""
    import torch

    probs = torch.softmax(logits, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    drop = sorted_p.cumsum(-1) - sorted_p > top_p  # (the likeliest token always stays)
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)


# ---------------------------------------------------------------------------------------------------------
# 3. Advantages
# ---------------------------------------------------------------------------------------------------------


def group_advantages(rewards: np.ndarray, generations: int, scale: str) -> np.ndarray:
    """Each completion's advantage from the rewards of its group (`generations` consecutive completions of one
    prompt), TRL's: r - its group's mean, divided by the group's standard deviation (unbiased, + 1e-4; `scale`
    "group"), by the whole micro-batch's ("batch"), or by nothing ("none")."""
    groups = rewards.reshape(-1, generations)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if scale == "group":
        centred = centred / (groups.std(axis=1, ddof=1, keepdims=True) + 1e-4)
    elif scale == "batch":
        centred = centred / ((rewards.std(ddof=1) if rewards.size > 1 else 0.0) + 1e-4)
    return centred.reshape(-1)


def pair_preferences(rewards: np.ndarray) -> np.ndarray:
    """objective online_dpo: each prompt's two completions (consecutive) as a preference pair, +1 for the chosen (the
    larger reward) and -1 for the rejected; 0 for both of a pair that scored alike, which prefers nothing (TRL takes
    the first as chosen there, a preference the rewards never stated: noise the model would learn)."""
    pairs = rewards.reshape(-1, 2)
    sign = np.sign(pairs[:, 0] - pairs[:, 1])
    return np.stack([sign, -sign], axis=1).reshape(-1)


def online_dpo_losses(logps, rows, preferences, ref_logps, loss: GrpoLoss, n_rows: int):
    """objective online_dpo (TRL's OnlineDPOTrainer, its sigmoid loss): the micro-batch's summed loss over its pairs
    that prefer one completion (`preferences`, `pair_preferences`: a tied pair prefers none and is left out), their
    count, and [the summed per-token log pi - log ref, pairs whose chosen completion has the larger implicit reward,
    the sum of the pairs' reward margins]. With r = beta (a completion's summed log pi - log ref), each pair's
    -log sigmoid(r(chosen) - r(rejected))."""
    import torch
    import torch.nn.functional as F

    r = loss.beta * (sequence_sums(logps, rows, n_rows) - sequence_sums(ref_logps, rows, n_rows))
    margin = (preferences * r).view(-1, 2).sum(1)  # r(chosen) - r(rejected)
    preferring = preferences.view(-1, 2)[:, 0] != 0
    losses = -F.logsigmoid(margin[preferring])
    figures = torch.stack(
        [(logps - ref_logps).detach().sum(), (margin[preferring] > 0).sum().float(), margin[preferring].detach().sum()]
    )
    return losses.sum(), int(preferring.sum()), figures


def leave_one_out_advantages(rewards: np.ndarray, generations: int, normalize: bool) -> np.ndarray:
    """RLOO's advantages: each reward less the mean of its group's other completions' (G / (G - 1) times its distance
    from the group's mean); with `normalize`, standardised over the micro-batch (mean 0, std 1; + 1e-4, TRL's)."""
    groups = rewards.reshape(-1, generations)
    baseline = (groups.sum(axis=1, keepdims=True) - groups) / (generations - 1)
    advantages = (groups - baseline).reshape(-1)
    if normalize and advantages.size:
        spread = advantages.std(ddof=1) if advantages.size > 1 else 0.0
        advantages = (advantages - advantages.mean()) / (spread + 1e-4)
    return advantages


# ---------------------------------------------------------------------------------------------------------
# 4. The loss
# ---------------------------------------------------------------------------------------------------------


def completion_batch(prompts: list[np.ndarray], completions: list[np.ndarray], pad_id: int, device) -> dict:
    """Each prompt (repeated for its consecutive completions) and completion as one right-padded row: `input_ids`,
    `attention_mask`, and `labels` counting the completion's tokens only."""
    import torch

    copies = len(completions) // max(len(prompts), 1)
    rows = [(prompts[i // copies], c) for i, c in enumerate(completions)] if prompts else []
    width = max((len(p) + len(c) for p, c in rows), default=2)
    n = max(len(rows), 1)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        seq = np.concatenate([p, c]).astype(np.int64)
        ids[i, : len(seq)] = torch.from_numpy(seq)
        labels[i, len(p) : len(seq)] = torch.from_numpy(np.asarray(c, dtype=np.int64))
        mask[i, : len(seq)] = 1
    if not rows:
        mask[0, 0] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def token_logprobs(model, inputs: dict, chunked: bool, temperature: float = 1.0):
    """The counted tokens' log-probabilities under `model`, in row order ([counted tokens]), and each one's row;
    its logits divided by `temperature` (the sampling temperature: TRL's, so that the policy trained is the one
    sampled from)."""
    from pylon.jobs.dpo import counted_logprobs

    args = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"], "use_cache": False}
    labels = inputs["labels"]
    if chunked:
        scale = {"logits_temperature": temperature} if temperature != 1.0 else {}
        lp = model(**args, labels=labels, token_logprobs=True, **scale).token_logprobs
    else:
        logits = model(**args).logits
        lp = counted_logprobs(logits / temperature if temperature != 1.0 else logits, labels)
    rows = (labels[:, 1:] != -100).nonzero()[:, 0]
    return lp.float(), rows


def sequence_sums(values, rows, n_rows: int):
    """Per completion (row), the sum of its counted tokens' `values`."""
    import torch

    return torch.zeros(n_rows, device=values.device, dtype=values.dtype).index_add(0, rows, values)


def correction_weights(old, drawn, rows, n_rows: int, loss: GrpoLoss):
    """grpo.sampler engine's importance-sampling correction (TRL's vllm_importance_sampling_correction and its
    modes): the ratio of the trained model's probability of each counted token (`old`, log pi_old) to the one the
    engine drew it with (`drawn`, its processed log-probabilities, in `token_logprobs`' order), per token (token_*) or
    per completion (sequence_*: exp of the sum of its tokens' log-ratios), held to [correction_min, correction_max]:
    clipped (*_truncate) or zero outside (*_mask). Returns the weights per token, and per completion (sequence_*; None
    for token_*), detached."""
    import torch

    diff = (old - drawn).detach()
    if loss.correction.startswith("sequence"):
        per_completion = _bounded(torch.exp(sequence_sums(diff, rows, n_rows)), loss)
        return per_completion[rows], per_completion
    return _bounded(torch.exp(diff), loss), None


def _bounded(ratio, loss: GrpoLoss):
    low, high = loss.correction_min, loss.correction_max
    if loss.correction.endswith("truncate"):
        return ratio.clamp(min=low, max=high)
    outside = (ratio < (low if low is not None else -math.inf)) | (ratio > (high if high is not None else math.inf))
    return ratio.masked_fill(outside, 0.0)


def grpo_losses(logps, rows, advantages, loss: GrpoLoss, n_rows: int, ref_logps=None, old_logps=None, weights=None):
    """The micro-batch's summed loss and what it is averaged over (`loss.kind`: its completion tokens for dapo and
    cispo, its completions for grpo and dr_grpo; bnpo, the mean over this rank's tokens already, over 1), and [the
    summed per-token KL (0 without a reference), tokens clipped below, tokens clipped above]. `logps`, `rows`:
    `token_logprobs`; `advantages` [rows]; `old_logps` the sampling policy's (None: the model is still that policy,
    its first update of the batch). TRL's clipped surrogate: with r = exp(log pi - log pi_old), -min(r A, clip(r, 1 -
    epsilon, 1 + epsilon_high) A), r bounded by `loss.delta` in its unclipped term where set (two-sided clipping,
    INTELLECT-2); r is 1 on the first update. cispo (MiniMax-M1's CISPO, TRL's): -min(r, epsilon_high) A log pi, the
    bounded weight without gradient, so that every token keeps its gradient (a clipped token's too), scaled.
    `loss.sequence_ratio` (GSPO, Zheng et al. 2025; TRL's importance_sampling_level "sequence"): every token of a
    completion takes its completion's r, exp of the mean over its tokens of log pi - log pi_old. `weights` (the engine
    sampler's correction, `correction_weights`' per token): each token's surrogate multiplied by its weight before the
    KL term is added (TRL's vllm_importance_sampling_correction)."""
    import torch

    old = logps.detach() if old_logps is None else old_logps
    a = advantages[rows]
    log_ratio = logps - old
    if loss.sequence_ratio:  # (its gradient through every token of the completion, as TRL's)
        counts = torch.bincount(rows, minlength=n_rows).clamp(min=1)
        log_ratio = (sequence_sums(log_ratio, rows, n_rows) / counts)[rows]
    ratio = torch.exp(log_ratio)
    if loss.kind == "cispo":
        per_token = -torch.clamp(ratio, max=loss.epsilon_high).detach() * a * logps
        low = torch.zeros((), device=logps.device)
        high = ((ratio > loss.epsilon_high) & (a > 0)).sum()  # (TRL's cispo_clip_ratio)
    else:
        clipped = torch.clamp(ratio, 1 - loss.epsilon, 1 + loss.epsilon_high)
        unclipped = ratio if loss.delta is None else torch.clamp(ratio, max=loss.delta)
        per_token = -torch.minimum(unclipped * a, clipped * a)
        low = ((ratio < 1 - loss.epsilon) & (a < 0)).sum()
        high = ((ratio > 1 + loss.epsilon_high) & (a > 0)).sum()
    if weights is not None:
        per_token = per_token * weights
    kl = torch.zeros((), device=logps.device)
    if ref_logps is not None:
        d = ref_logps - logps
        per_token_kl = torch.exp(d) - d - 1
        per_token = per_token + loss.beta * per_token_kl
        kl = per_token_kl.detach().sum()
    figures = torch.stack([kl.float(), low.float(), high.float()])
    if loss.kind in ("dapo", "cispo"):
        return per_token.sum(), int(logps.numel()), figures
    if loss.kind == "bnpo":  # (this rank's token mean: `_global_mean_loss` then averages ranks with data, as TRL's)
        return per_token.sum() / max(int(logps.numel()), 1), int(logps.numel() > 0), figures
    sums = sequence_sums(per_token, rows, n_rows)
    if loss.kind == "grpo":
        counts = torch.bincount(rows, minlength=n_rows).clamp(min=1)
        return (sums / counts).sum(), n_rows, figures
    return sums.sum() / loss.max_tokens, n_rows, figures  # dr_grpo


def rloo_losses(logps, rows, advantages, loss: GrpoLoss, n_rows: int, old_seq=None, weights=None):
    """objective rloo: the micro-batch's summed loss over its completions, their count, and [0 (its KL is in the
    reward), completions clipped below, completions clipped above]. Per completion, with r = exp(its tokens' summed
    log pi - `old_seq`, the same under the sampling policy; None: the model is still that policy), the clipped
    surrogate -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) (TRL's RLOOTrainer), times its weight in
    `weights` (the engine sampler's sequence-level correction, `correction_weights`' per completion)."""
    import torch

    seq = sequence_sums(logps, rows, n_rows)
    old = seq.detach() if old_seq is None else old_seq
    ratio = torch.exp(seq - old)
    clipped = torch.clamp(ratio, 1 - loss.epsilon, 1 + loss.epsilon_high)
    per_completion = -torch.minimum(ratio * advantages, clipped * advantages)
    if weights is not None:
        per_completion = per_completion * weights
    low = ((ratio < 1 - loss.epsilon) & (advantages < 0)).sum()
    high = ((ratio > 1 + loss.epsilon_high) & (advantages > 0)).sum()
    figures = torch.stack([torch.zeros((), device=logps.device), low.float(), high.float()])
    return per_completion.sum(), n_rows, figures


# ---------------------------------------------------------------------------------------------------------
# One micro-batch
# ---------------------------------------------------------------------------------------------------------

STAT_NAMES = (
    "completions",
    "reward",
    "reward_std",
    "groups",
    "zero_std_groups",
    "length",
    "clipped",
    "kl",
    "kl_tokens",
    "clipped_low",
    "clipped_high",
    "policy_tokens",
    "sampler_ratio",
)


@dataclass
class Rollout:
    """A micro-batch's completions, sampled and scored (steps 1-3): what `grpo_train` trains on, once, or
    `iterations` times (then with the sampling policy's log-probabilities, `old_logps`)."""

    inputs: dict  # `completion_batch`
    advantages: object  # [completions] float32 tensor
    completions: int
    tokens: int  # completion tokens
    stats: list  # STAT_NAMES' sampling figures (completions .. clipped), then each function's score sum and count
    sample_s: float
    old_logps: object = None
    kl: tuple = (0.0, 0.0)  # objective rloo with beta > 0: the summed per-token KL at sampling, and its tokens
    sampled_tokens: int = 0  # what sampling's forward passes computed: each completion's prompt and its tokens
    model_tokens: int = 0  # the non-pad tokens of `inputs`, which each update's passes compute
    samples: list = field(default_factory=list)  # its first `log_completions` completions (`completion_samples`)
    # grpo.sampler engine with its correction (`correction_weights`): objective grpo's weight of each counted token,
    # rloo's of each completion; detached
    sampler_ratio: object = None

    def trained_token_units(self, loss: "GrpoLoss", fresh: bool) -> float:
        """The model FLOPs of training on this rollout once, in units of a trained token's (forward + backward = 3
        forward passes, `flops_per_token`): the update over prompts and completions, the reference's forward pass
        (beta > 0) and, on the step that sampled (`fresh`), sampling's forward passes (one per prompt token of each
        completion and per sampled token, with the KV cache) and the sampling policy's log-probabilities
        (iterations > 1). Sampling's attention over its cache is counted at the training context's rate."""
        units = self.model_tokens * (4 / 3 if loss.needs_reference and not loss.rloo else 1.0)
        if fresh:  # (rloo takes the reference's pass at sampling)
            passes = int(loss.sampling_logprobs) + int(loss.rloo and loss.needs_reference)
            units += (self.sampled_tokens + passes * self.model_tokens) / 3
        return units


def grpo_sample(
    engine,
    batch,
    loss: GrpoLoss,
    rewards: Rewards,
    tokenizer,
    *,
    eos_id: int,
    pad_id: int,
    seed: int,
    synced: bool = False,
    reference=None,
    rollout=None,
) -> Rollout:
    """Sample and score one micro-batch (steps 1-3); with `loss.iterations` > 1, the sampling policy's
    log-probabilities too (a pass without gradients), which the later updates' ratios are taken against. objective
    rloo with beta > 0: those and the reference's (`reference`, the frozen copy, or None: `engine.module` with its
    adapters disabled), each completion's reward less beta x its summed KL before its advantage. `rollout`: a
    `pylon.jobs.rollout.RolloutEngine` that samples instead of the model (`grpo.sampler: engine`), given the
    policy's weights first where they changed."""
    import torch

    device = engine.device
    pairs = prompts_and_answers(batch, eos_id) if batch is not None and len(batch) else []
    prompts = [p for p, _, _ in pairs]
    t0 = time.perf_counter()
    drawn = None  # grpo.sampler engine with its correction: each completion's tokens' logprobs as the engine drew them
    if rollout is not None:
        rollout.current(engine)
        computed = rollout.computed_tokens
        completions = rollout.sample(prompts, loss, seed=seed, logprobs=loss.corrects)
        drawn = rollout.last_logprobs if loss.corrects else None
        computed = rollout.computed_tokens - computed
    else:
        with sampling_model(engine, loss, synced) as (sampler, in_step):
            completions = sample_completions(
                sampler, prompts, loss, eos_id=eos_id, pad_id=pad_id, device=device, seed=seed, synced=in_step
            )
        computed = loss.generations * sum(len(p) for p in prompts) + sum(len(c) for c in completions)
    sample_s = time.perf_counter() - t0
    g = loss.generations
    k = len(rewards.functions)
    inputs = completion_batch(prompts, completions, pad_id, device)
    cut = [i for i, c in enumerate(completions) if not (len(c) and c[-1] == eos_id)]
    if loss.mask_truncated and cut:  # (TRL's: no token of theirs counted; each still one of the completions)
        inputs["labels"][torch.as_tensor(cut, device=device)] = -100
    old, seq_kl, kl, ratio = None, np.zeros(len(completions)), (0.0, 0.0), None
    if loss.sampling_logprobs:
        with torch.no_grad():
            old, rows = token_logprobs(engine, inputs, loss.chunked, loss.temperature)
            if drawn is not None:  # (in `token_logprobs`' order: each counted completion's tokens in turn)
                masked = set(cut) if loss.mask_truncated else set()
                flat = [lp for i, lps in enumerate(drawn) if i not in masked for lp in lps]
                sampled = torch.as_tensor(np.asarray(flat, dtype=np.float32), device=old.device)
                per_token, per_completion = correction_weights(old, sampled, rows, len(completions), loss)
                ratio = per_completion if loss.rloo else per_token
            if loss.rloo and loss.needs_reference:  # (every rank: at ZeRO-3 its passes gather collectively)
                ref = reference_logprobs(
                    engine, reference, inputs, loss.chunked, owner=engine.module, temperature=loss.temperature
                )
                if completions:
                    seq_kl = sequence_sums(old - ref, rows, len(completions)).cpu().numpy().astype(np.float64)
                    kl = (float(seq_kl.sum()), float(old.numel()))
    if completions:
        scores = rewards.score_completions(pairs, completions, tokenizer, eos_id)
        reward = rewards.total(scores)
        if loss.rloo:  # the KL to the start is a cost in the reward (TRL's RLOO); the figures report the reward
            advantages = leave_one_out_advantages(reward - loss.beta * seq_kl, g, loss.normalize)
        elif loss.online_dpo:
            advantages = pair_preferences(reward)
        else:
            advantages = group_advantages(reward, g, loss.scale)
        group_std = reward.reshape(-1, g).std(axis=1, ddof=1)
    else:
        scores, reward, advantages, group_std = np.zeros((0, k)), np.zeros(0), np.zeros(1), np.zeros(0)
    lengths = [len(c) for c in completions]
    stats = [
        float(len(completions)),
        float(reward.sum()),
        float(group_std.sum()),
        float(len(group_std)),
        float((group_std < 1e-8).sum()),
        float(sum(lengths)),
        float(len(cut)),
        *rewards.sums(scores),
    ]
    return Rollout(
        inputs=inputs,
        advantages=torch.as_tensor(advantages, dtype=torch.float32, device=device),
        completions=len(completions),
        tokens=int(sum(lengths)),
        stats=stats,
        sample_s=sample_s,
        old_logps=old,
        kl=kl,
        sampled_tokens=int(computed) if completions else 0,
        model_tokens=int(inputs["attention_mask"].sum()) if completions else 0,
        samples=completion_samples(
            pairs, completions, scores, reward, advantages, rewards.names, tokenizer, eos_id, loss
        ),
        sampler_ratio=ratio,
    )


def completion_samples(
    pairs, completions, scores, reward, advantages, names, tokenizer, eos_id: int, loss: GrpoLoss
) -> list:
    """The first `loss.log_completions` completions as records (`run_dir.CompletionsLog`, TRL's completions table):
    the decoded prompt, completion (without its eos) and answer, each function's score (None: no score), the
    reward, the advantage, its tokens and whether it ended with the eos."""
    g = loss.generations
    out = []
    for i in range(min(loss.log_completions, len(completions))):
        prompt, answer, _ = pairs[i // g]
        ended = bool(len(completions[i]) and completions[i][-1] == eos_id)
        out.append(
            {
                "prompt": tokenizer.decode(prompt),
                "completion": tokenizer.decode(_without_eos(completions[i], eos_id)),
                "answer": tokenizer.decode(answer),
                "rewards": {n: None if np.isnan(v) else float(v) for n, v in zip(names, scores[i])},
                "reward": float(reward[i]),
                "advantage": float(advantages[i]),
                "tokens": int(len(completions[i])),
                "ended": ended,
            }
        )
    return out


def grpo_train(engine, module, rollout: Rollout, loss: GrpoLoss, reference=None, first: bool = True) -> tuple:
    """Step 4 on a `Rollout`: the reference's pass (beta > 0; `reference` the frozen copy, or None: `module` with its
    adapters disabled), then the trained one. `first`: the batch's first update (the model is still the sampling
    policy). Returns (the summed loss as a tensor, what it is averaged over, completion tokens counted,
    [STAT_NAMES' sums..., each reward function's score sum..., and count...])."""
    import torch

    inputs = rollout.inputs
    n_rows = int(inputs["input_ids"].shape[0])
    ref = None
    if loss.needs_reference and not loss.rloo:  # (rloo's reference was read at sampling: its KL is in the reward)
        with torch.no_grad():
            ref = reference_logprobs(module, reference, inputs, loss.chunked, temperature=loss.temperature)
    logps, rows = token_logprobs(engine, inputs, loss.chunked, loss.temperature)
    old = None if first else rollout.old_logps
    if loss.rloo:
        old_seq = None if old is None else sequence_sums(old, rows, n_rows)
        loss_sum, count, figures = rloo_losses(
            logps, rows, rollout.advantages, loss, n_rows, old_seq, weights=rollout.sampler_ratio
        )
    elif loss.online_dpo:
        loss_sum, count, figures = online_dpo_losses(logps, rows, rollout.advantages, ref, loss, n_rows)
    else:
        loss_sum, count, figures = grpo_losses(
            logps, rows, rollout.advantages, loss, n_rows, ref, old, weights=rollout.sampler_ratio
        )
    if not rollout.completions:
        loss_sum, count = loss_sum * 0.0, 0
    kl, low, high = figures.tolist() if rollout.completions else (0.0, 0.0, 0.0)
    n = float(logps.numel()) if rollout.completions else 0.0
    kl_tokens = n if ref is not None else 0.0
    if loss.rloo:  # its KL at sampling; the clip figures count completions, its loss's units
        kl, kl_tokens, n = *rollout.kl, float(rollout.completions)
    k = (len(rollout.stats) - 7) // 2
    weights = rollout.sampler_ratio
    ratio_sum = float(weights.sum()) if weights is not None and rollout.completions else 0.0
    stats = [*rollout.stats[:7], kl, kl_tokens, low, high, n, ratio_sum, *rollout.stats[7 : 7 + 2 * k]]
    return loss_sum, count, rollout.tokens, stats


def reference_logprobs(model, reference, inputs: dict, chunked: bool, owner=None, temperature: float = 1.0):
    """The reference's log-probabilities of `inputs`' counted tokens (no gradients; at `temperature`, as
    `token_logprobs`): `reference`, the frozen copy, or None: `model` run with the LoRA adapters of `owner` (the
    model itself where None; the engine's module where `model` is the DeepSpeed engine) disabled."""
    import torch

    from pylon.jobs.dpo import as_reference

    with torch.no_grad():
        if reference is not None:
            return token_logprobs(reference, inputs, chunked, temperature)[0]
        with as_reference(model if owner is None else owner):
            return token_logprobs(model, inputs, chunked, temperature)[0]


def grpo_forward(
    engine,
    module,
    batch,
    loss: GrpoLoss,
    rewards: Rewards,
    tokenizer,
    *,
    eos_id: int,
    pad_id: int,
    seed: int,
    reference=None,
    synced: bool = False,
) -> tuple:
    """Sample, score and train one micro-batch once (steps 1-4: `grpo_sample`, then `grpo_train`). Returns
    `grpo_train`'s figures and the seconds spent sampling."""
    rollout = grpo_sample(
        engine, batch, loss, rewards, tokenizer, eos_id=eos_id, pad_id=pad_id, seed=seed, synced=synced,
        reference=reference,
    )  # fmt: skip
    return (*grpo_train(engine, module, rollout, loss, reference), rollout.sample_s)


def grpo_record(
    sums: list[float],
    names: list[str],
    prefix: str = "",
    online_dpo: bool = False,
    corrected: bool = False,
    judged: bool = False,
) -> dict:
    """A step's (or with `prefix` "val_", an evaluation's) figures from `grpo_forward`'s stats summed over
    micro-batches and ranks. `online_dpo`: its pairs' implicit reward accuracy and margin (in the clip figures'
    places) instead of a clip ratio. `corrected` (`GrpoLoss.corrects`): the engine sampler's mean correction weight
    too, 0 in a step whose every token a mask mode left out. `judged` (`Rewards.judged`): no reward figures, since a
    judge's scores only mark which of a pair it preferred (`grpo_zero_std_groups`: the share of pairs it left
    undecided), and the run's plot is its loss."""
    s = dict(zip(STAT_NAMES, sums))
    n = max(s["completions"], 1.0)
    k = len(names)
    func_sums, func_counts = sums[len(STAT_NAMES) : len(STAT_NAMES) + k], sums[len(STAT_NAMES) + k :]
    p = f"{prefix}grpo_"
    record = {
        f"{p}completions": int(s["completions"]),
        f"{p}reward": s["reward"] / n,
        f"{p}reward_std": s["reward_std"] / max(s["groups"], 1.0),
        f"{p}zero_std_groups": s["zero_std_groups"] / max(s["groups"], 1.0),
        f"{p}completion_length": s["length"] / n,
        f"{p}clipped": s["clipped"] / n,
    }
    if judged:
        del record[f"{p}reward"], record[f"{p}reward_std"]
    if s["kl_tokens"]:
        record[f"{p}kl"] = s["kl"] / s["kl_tokens"]
    if online_dpo:  # (TRL's rewards/accuracies and rewards/margins, over the pairs that prefer one completion)
        pairs = max(s["groups"] - s["zero_std_groups"], 1.0)
        record[f"{prefix}online_dpo_reward_accuracy"] = s["clipped_low"] / pairs
        record[f"{prefix}online_dpo_reward_margin"] = s["clipped_high"] / pairs
    elif s["policy_tokens"]:  # the share of tokens whose ratio the clip held (TRL's clip_ratio; 0 on a first update)
        record[f"{p}clip_ratio"] = (s["clipped_low"] + s["clipped_high"]) / s["policy_tokens"]
        if corrected:  # grpo.sampler engine's correction: its mean weight (per token; rloo: per completion)
            record[f"{p}sampler_ratio"] = s["sampler_ratio"] / s["policy_tokens"]
    if not judged:
        for name, total, count in zip(names, func_sums, func_counts):
            record[f"{p}rewards.{name}"] = total / count if count else None
    return record


class GrpoEvaluation:
    """A held-out batch's figures (`_evaluate`'s `grpo_eval`): each prompt's greedy completion, scored (not with a
    pairwise judge, which compares two: its length alone). Called with a batch, returns [completions, reward sum,
    length sum, each function's score sum..., and count...]."""

    def __init__(
        self, engine, loss: GrpoLoss, rewards: Rewards, tokenizer, eos_id, pad_id, device, synced, rollout=None
    ) -> None:
        self.engine, self.loss, self.rewards, self.tokenizer = engine, loss, rewards, tokenizer
        self.eos_id, self.pad_id, self.device, self.synced = eos_id, pad_id, device, synced
        self.rollout = rollout  # grpo.sampler: engine (`grpo_sample`'s)
        self.names = rewards.names

    def __call__(self, batch) -> list[float]:
        pairs = prompts_and_answers(batch, self.eos_id) if len(batch) else []
        if self.rollout is not None:
            self.rollout.current(self.engine)
            completions = self.rollout.sample([p for p, _, _ in pairs], self.loss, seed=0, greedy=True, copies=1)
        else:
            completions = self._sample(pairs)
        k = len(self.rewards.functions)
        if not completions:
            return [0.0] * (3 + 2 * k)
        if self.rewards.judged:  # (one greedy completion a prompt: nothing for a judge of pairs to compare)
            scores = np.full((len(completions), k), np.nan)
        else:
            scores = self.rewards.score_completions(pairs, completions, self.tokenizer, self.eos_id)
        return [
            float(len(completions)),
            float(self.rewards.total(scores).sum()),
            float(sum(len(c) for c in completions)),
            *self.rewards.sums(scores),
        ]

    def _sample(self, pairs) -> list[np.ndarray]:
        with sampling_model(self.engine, self.loss, self.synced) as (sampler, in_step):
            return sample_completions(
                sampler,
                [p for p, _, _ in pairs],
                self.loss,
                eos_id=self.eos_id,
                pad_id=self.pad_id,
                device=self.device,
                seed=0,
                greedy=True,
                copies=1,
                synced=in_step,
            )


def grpo_eval_record(sums: list[float], names: list[str]) -> dict:
    """An evaluation's figures from `GrpoEvaluation`'s sums over batches and ranks."""
    n, k = max(sums[0], 1.0), len(names)
    record = {
        "val_grpo_completions": int(sums[0]),
        # (None where nothing scored a completion: a judge's run, whose judge compares pairs)
        "val_grpo_reward": sums[1] / n if any(sums[3 + k :]) or not k else None,
        "val_grpo_completion_length": sums[2] / n,
    }
    for name, total, count in zip(names, sums[3 : 3 + k], sums[3 + k :]):
        record[f"val_grpo_rewards.{name}"] = total / count if count else None
    return record


def _without_eos(ids: np.ndarray, eos_id: int) -> np.ndarray:
    return ids[:-1] if len(ids) and ids[-1] == eos_id else ids
