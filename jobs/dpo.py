"""Preference tuning: direct preference optimisation (`TrainJobSpec.objective: dpo`; Rafailov et al. 2023, the
sigmoid loss of TRL's `DPOTrainer`) and the reference-free SimPO and ORPO (`objective: simpo`, `orpo`, below): the
model learns to prefer each pair's chosen completion over its rejected one, with no reward model and no sampling; and
reward models (`objective: reward`, below), trained on the same pairs.

For a pair (prompt x, chosen y_w, rejected y_l), with log pi(y | x) the summed log-probability of a completion's tokens
(and its eos) under the model being trained and log ref(y | x) the same under the reference (the model as it
started):

    reward(y) = beta * (log pi(y | x) - log ref(y | x))
    loss = -log sigmoid(reward(y_w) - reward(y_l))

averaged over every pair of the global batch. At the first step pi is ref, so every pair's loss is log 2; the loss
falls as the margin between the rewards grows, `beta` setting how far from the reference that may go. TRL's other
losses (`dpo_loss`, with h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l))): "hinge", relu(1 - beta h)
(SLiC; 1 at the start); "ipo", (h - 1 / (2 beta))^2 with each completion's log-probability its tokens' mean (Azar et
al. 2023; 1 / (4 beta^2) at the start); robust, exo_pair, nca_pair, bco_pair (its rewards' running mean kept in
checkpoints: `RunningMean`), sppo_hard, aot, aot_pair, apo_zero, apo_down and discopop as TRL writes them
(`dpo_losses`); and `dpo_label_smoothing` e for the sigmoid loss (and robust, exo_pair and
AOT's), the pairs' labels taken as wrong with probability e (conservative DPO: -(1 - e) log sigmoid(beta h) - e log
sigmoid(-beta h)); `dpo_rpo_alpha` a
adds a times the chosen completion's negative log-likelihood, its tokens' mean (RPO, Pang et al. 2024; TRL's
`rpo_alpha`, as Llama 3's preference tuning did), so that the chosen completion's likelihood does not fall.

The data (`pylon data prepare --preference`) holds each pair as two documents in one row, chosen first, each attended
on its own (`attention_mask: document`): `sequence_logprobs` sums each document's counted tokens in row order, and
`pair_up` reads them two by two. The reference costs one more forward pass without gradients per micro-batch, run
first so that its activations are gone before the trained pass keeps its own. It is, as in TRL:

- with `lora`, the same model with its adapters disabled (peft's `disable_adapter`): no second copy of the weights;
- without (full fine-tuning), a frozen copy of the model as it starts (`frozen_reference`: built from the same
  `model` and seed, so the same weights, and rebuilt so on resumption, never checkpointed), in the training
  precision: at ZeRO 0-2 whole on every rank (2 bytes a parameter in bf16), at ZeRO-3 partitioned like the trained
  model and gathered layer by layer for its forward (a DeepSpeed engine without an optimizer, offloaded where the
  trained model's parameters are).

SimPO (Meng et al. 2024; TRL's `CPOTrainer` with loss_type "simpo" and cpo_alpha 0) and ORPO (Hong et al. 2024; TRL's
`ORPOTrainer`) need no reference, so neither a frozen copy nor a second forward pass, and train LoRA or the whole model
alike. With m(y) a completion's mean token log-probability under the model being trained:

    simpo: loss = -log sigmoid(beta * (m(y_w) - m(y_l)) - gamma)          (`simpo_gamma`; smoothed as DPO's may be)
    orpo:  loss = -m(y_w) - beta * log sigmoid(log odds(y_w) - log odds(y_l)),  odds(y) = p / (1 - p), p = exp(m(y))

ORPO's first term is the chosen completion's negative log-likelihood (its tokens' mean, per pair: the paper's
expectation over pairs, where TRL averages over a batch's chosen tokens), so it fine-tunes and aligns in one stage.
Both report rewards beta * m(y), as TRL does.

A reward model (`objective: reward`; TRL's `RewardTrainer`) is the model with a scalar head (its family's
`*ForSequenceClassification`, one label: `pylon.models.with_head`) read at each completion's last token before the
eos `prepare` appends, or a conversation's last token (`document_rewards`: where serving reads what a client sends,
text or messages), trained so that the chosen
completion scores higher (Bradley-Terry, Ouyang et al. 2022):

    reward: loss = -log sigmoid(r(y_w) - r(y_l)) + c (r(y_w) + r(y_l))^2      (c: `reward_center_coefficient`, 0)

The head's output at every position is taken by a forward hook (`pylon.models.head_outputs`: the classifier itself
returns each row's last only, and a packed row holds several completions), inside the model's own forward, so ZeRO-3
gathers the head as it gathers any module.

Logged per step and per evaluation (TRL's names, under the objective's: `dpo_`, `simpo_`, `orpo_`, `reward_`): the
rewards of the chosen and the rejected completions, their margin, and the reward accuracy (the share of pairs whose
chosen completion has the larger reward); a reward model's are `reward_loss`, `reward_chosen`, `reward_rejected`,
`reward_margin`, `reward_accuracy`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

from pylon.data.shards import DataError

LOG_2 = math.log(2.0)  # every pair's sigmoid loss while the model is still its reference
REFERENCE_FREE = ("simpo", "orpo", "reward")  # the losses that need no reference model


@dataclass(frozen=True)
class DpoLoss:
    """Which preference loss, and its settings (`TrainJobSpec.objective`, `dpo_beta`, `dpo_loss`,
    `dpo_label_smoothing`, `simpo_gamma`, `dpo_rpo_alpha`, `reward_center_coefficient`, `dpo_discopop_tau`,
    `loss_chunk_tokens`)."""

    beta: float = 0.1
    kind: str = "sigmoid"  # objective dpo's `dpo_loss` ("sigmoid", "hinge", "ipo", ...); or "simpo", "orpo", "reward"
    label_smoothing: float = 0.0
    gamma: float = 0.5  # simpo's margin
    chunked: bool = False  # the model computes its output layer a chunk of tokens at a time (`loss_chunk_tokens`)
    rpo_alpha: float = 0.0  # objective dpo: the weight of the chosen completion's NLL (RPO)
    center: float = 0.0  # objective reward: the weight of each pair's squared reward sum
    discopop_tau: float = 0.05  # dpo_loss discopop: the temperature of its blend
    # objective reward: the pairs are conversations (`ShardManifest.preference_format`), each read at its last token
    conversations: bool = False
    # objective dpo with a list of losses (TRL's loss_type list and loss_weights, MPO): each (loss, weight), `kind`
    # then "mix"; TRL's "sft" among them is the chosen completion's NLL, `rpo_alpha`'s term, in `rpo_alpha`
    mix: tuple[tuple[str, float], ...] = ()

    @classmethod
    def of(cls, spec, manifest=None) -> "DpoLoss":
        """The loss `spec` asks for, on the dataset of `manifest` (how its pairs were given: a reward model's
        reading)."""
        kind = spec.dpo_loss if spec.objective == "dpo" else spec.objective
        mix, rpo_alpha = (), spec.dpo_rpo_alpha
        if isinstance(kind, list):  # (a list of one is that loss, weighted)
            weights = spec.dpo_loss_weights or [1.0] * len(kind)
            mix = tuple((k, float(w)) for k, w in zip(kind, weights) if k != "sft")
            rpo_alpha += sum(float(w) for k, w in zip(kind, weights) if k == "sft")
            kind = "mix"
        return cls(
            beta=spec.dpo_beta,
            kind=kind,
            mix=mix,
            label_smoothing=spec.dpo_label_smoothing,
            gamma=spec.simpo_gamma,
            chunked=spec.loss_chunk_tokens > 0,
            rpo_alpha=rpo_alpha,
            center=spec.reward_center_coefficient,
            discopop_tau=spec.dpo_discopop_tau,
            conversations=getattr(manifest, "preference_format", None) == "conversational",
        )

    @property
    def objective(self) -> str:
        """The objective's name, which its figures are logged under."""
        return self.kind if self.kind in REFERENCE_FREE else "dpo"

    @property
    def needs_reference(self) -> bool:
        return self.kind not in REFERENCE_FREE

    @property
    def scores(self) -> bool:
        """Whether the pairs are scored by a reward head (objective reward) rather than by log-probabilities."""
        return self.kind == "reward"

    @property
    def mean(self) -> bool:
        """Whether a completion's log-probability is its tokens' mean (IPO, SimPO, ORPO) rather than their sum."""
        return self.kind in ("ipo", *REFERENCE_FREE)

    @property
    def bco(self) -> bool:
        """Whether bco_pair is its loss, or one of its mix: the rewards' running mean is kept (`RunningMean`)."""
        return self.kind == "bco_pair" or any(k == "bco_pair" for k, _ in self.mix)

    def at_start(self) -> float:
        """Every pair's loss while the model is its reference (h = 0): objective dpo's losses only (a mix's: their
        weighted sum, its NLL term aside)."""
        if self.mix:
            return sum(w * dataclasses.replace(self, kind=k, mix=()).at_start() for k, w in self.mix)
        e = self.label_smoothing or 1e-3  # (exo_pair's)
        return {
            "sigmoid": LOG_2,
            "robust": LOG_2,
            "aot": LOG_2,
            "aot_pair": LOG_2,
            "hinge": 1.0,
            "ipo": 1.0 / (4.0 * self.beta**2),
            "exo_pair": -LOG_2 - 0.5 * (math.log(1 - e) + math.log(e)),
            "nca_pair": 2 * LOG_2,
            "bco_pair": 2 * LOG_2,
            "sppo_hard": 0.5 / self.beta**2,
            "apo_zero": 1.0,
            "apo_down": 1.0,
            "discopop": 0.5 * LOG_2 + 0.5,
        }[self.kind]


class RunningMean:
    """dpo_loss bco_pair's delta: the running mean of every micro-batch's mean reward, over every rank (TRL's
    `RunningMoments` mean: each rank's micro-batch one value), kept in the run's checkpoints so that a resumed run
    goes on with it."""

    def __init__(self) -> None:
        self.mean, self.count = 0.0, 0

    def update(self, value) -> float:
        """Add this rank's micro-batch mean reward (None: it had no pair) and every other rank's; a collective call
        when a process group is up. Returns the new mean."""
        import torch
        import torch.distributed as dist

        device = value.device if value is not None else None
        if device is None and dist.is_initialized() and dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        both = torch.tensor(
            [float(value) if value is not None else 0.0, 1.0 if value is not None else 0.0],
            dtype=torch.float64,
            device=device,
        )
        if dist.is_initialized():
            dist.all_reduce(both)
        total, k = both.tolist()
        if k:
            self.mean = (self.mean * self.count + total) / (self.count + k)
            self.count += int(k)
        return self.mean

    def state_dict(self) -> dict:
        return {"mean": self.mean, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.count = float(state["mean"]), int(state["count"])


def sequence_logprobs(logits, labels, position_ids, mean: bool = False):
    """Each document's summed log-probability of its counted tokens (`labels` not -100; `mean`: their mean), in row
    order, and how many documents each row holds. A document is a run of `position_ids` from 0
    (`Batch.to_torch(documents=True)`); the padding, which counts no token, is none. Returns ([documents] float32,
    [rows] int64)."""
    sums, counts, per_row = _sums_and_counts(counted_logprobs(logits, labels), labels, position_ids)
    return (sums / counts if mean else sums), per_row


def counted_logprobs(logits, labels):
    """The counted tokens' log-probabilities (`labels[:, 1:]` not -100, row by row) from a batch's logits."""
    import torch.nn.functional as F

    rows, length, vocab = logits.shape
    targets = labels[:, 1:]
    token_lp = -F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab).float(), targets.reshape(-1), ignore_index=-100, reduction="none"
    ).view(rows, length - 1)
    return token_lp[targets != -100]


def _sums_and_counts(token_lp, labels, position_ids) -> tuple:
    """Each document's summed log-probability and counted tokens, in row order, and how many documents each row
    holds, from the counted tokens' log-probabilities alone (`token_lp`, [counted tokens], in the order of
    `labels[:, 1:]`'s counted positions, row by row: `counted_logprobs`, or what a model under `loss_chunk_tokens`
    returns, its `TokenLoss.token_logprobs`, without ever holding a micro-batch's logits)."""
    import torch

    rows, length = labels.shape
    counted = labels[:, 1:] != -100
    segment = torch.cumsum(position_ids == 0, dim=1) - 1  # each token's document in its row
    key = (torch.arange(rows, device=labels.device)[:, None] * length + segment[:, 1:])[counted]
    sums = torch.zeros(rows * length, dtype=torch.float32, device=labels.device).index_add(0, key, token_lp.float())
    counts = torch.zeros(rows * length, dtype=torch.int64, device=labels.device).index_add(0, key, torch.ones_like(key))
    present = counts > 0
    return sums[present], counts[present], present.view(rows, length).sum(dim=1)


def document_rewards(scores, labels, position_ids, eos_id: int | None = None, conversations: bool = False):
    """Each document's reward: the head's output (`scores`, [rows, length]) read where a client's request is read, in
    row order, and how many documents each row holds (as `sequence_logprobs`). Text pairs: at the completion's last
    token (`labels` not -100), the eos `prepare` appends after it left out (a completion of eos alone: read there),
    since the prompt and completion a client scores as text have no eos. `conversations`: at the document's last
    token, counted or not (a template's end of turn, which may be the eos, or what follows it), since a conversation
    a client scores (`/classify` with `messages`) is rendered by the same template. Pylon's serving and transformers'
    classifier read each at that same token."""
    import torch

    rows, length = labels.shape
    device = labels.device
    counted = labels != -100
    segment = torch.cumsum(position_ids == 0, dim=1) - 1
    keys = torch.arange(rows, device=device)[:, None] * length + segment
    index = torch.arange(length, device=device).expand(rows, length)

    def last(where):
        out = torch.full((rows * length,), -1, dtype=torch.int64, device=device)
        return out.scatter_reduce(0, keys[where], index[where], reduce="amax")

    ends = last(counted)
    present = ends >= 0
    if conversations:
        at = last(torch.ones_like(counted))[present]
    else:
        text = last(counted & (labels != eos_id)) if eos_id is not None else ends
        at = torch.where(text >= 0, text, ends)[present]
    row_of = torch.arange(rows * length, device=device)[present] // length
    return scores[row_of, at].float(), present.view(rows, length).sum(dim=1)


def pair_up(logprobs, per_row, where: str):
    """(chosen, rejected) log-probabilities: each row's documents two by two, chosen first. A row of an odd number of
    documents is not a preference dataset's: a DataError naming `where` (the dataset)."""
    odd = (per_row % 2 != 0).nonzero()
    if odd.numel():
        raise DataError(
            f"{where}: a row holds {int(per_row[odd[0, 0]])} documents, not preference pairs; objectives dpo, simpo, "
            "orpo and reward train on a dataset prepared with `pylon data prepare --preference`"
        )
    return logprobs[0::2], logprobs[1::2]


def dpo_losses(chosen, rejected, ref_chosen, ref_rejected, loss: DpoLoss, delta: float = 0.0):
    """Each pair's loss and its chosen and rejected rewards (the rewards detached: they are reported, not trained).
    SimPO, ORPO and a reward model take no reference (`ref_chosen`, `ref_rejected` None). `delta`: bco_pair's running
    mean of the rewards (`RunningMean`)."""
    import torch
    import torch.nn.functional as F

    if loss.mix:  # TRL's loss_type list: each loss weighted, summed (the rewards are every dpo loss's)
        total = 0.0
        for kind, weight in loss.mix:
            part, chosen_rewards, rejected_rewards = dpo_losses(
                chosen, rejected, ref_chosen, ref_rejected, dataclasses.replace(loss, kind=kind, mix=()), delta
            )
            total = total + weight * part
        return total, chosen_rewards, rejected_rewards
    beta, e = loss.beta, loss.label_smoothing
    if loss.kind == "reward":  # Bradley-Terry on the rewards themselves (and TRL's centring term)
        losses = -F.logsigmoid(chosen - rejected)
        if loss.center:
            losses = losses + loss.center * (chosen + rejected) ** 2
        return losses, chosen.detach(), rejected.detach()
    if loss.kind == "orpo":
        # log odds(y) = m - log(1 - exp(m)); expm1 keeps 1 - p exact as p nears 1 (clamped below: m < 0)
        def log_odds(m):
            return m - torch.log(-torch.expm1(m.clamp(max=-1e-6)))

        losses = -chosen - beta * F.logsigmoid(log_odds(chosen) - log_odds(rejected))
        return losses, (beta * chosen).detach(), (beta * rejected).detach()
    if loss.kind == "simpo":
        z = beta * (chosen - rejected) - loss.gamma
        losses = -F.logsigmoid(z) * (1 - e) - F.logsigmoid(-z) * e
        return losses, (beta * chosen).detach(), (beta * rejected).detach()
    a, b = chosen - ref_chosen, rejected - ref_rejected  # each completion's log-ratio to the reference
    h = a - b
    kind = loss.kind

    def smoothed(z):  # DPO's sigmoid loss, its labels wrong with probability e (conservative DPO)
        return -F.logsigmoid(beta * z) * (1 - e) - F.logsigmoid(-beta * z) * e

    if kind == "hinge":
        losses = torch.relu(1 - beta * h)
    elif kind == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif kind == "robust":  # an unbiased estimate under label noise e (Chowdhury et al. 2024)
        losses = (-F.logsigmoid(beta * h) * (1 - e) + F.logsigmoid(-beta * h) * e) / (1 - 2 * e)
    elif kind == "exo_pair":  # EXO (Ji et al. 2024, eq. 16); e 0 taken as 1e-3, as TRL does
        e = e or 1e-3
        z = beta * h
        losses = torch.sigmoid(z) * (F.logsigmoid(z) - math.log(1 - e)) + torch.sigmoid(-z) * (
            F.logsigmoid(-z) - math.log(e)
        )
    elif kind == "nca_pair":  # NCA (Chen et al. 2024)
        losses = -F.logsigmoid(beta * a) - 0.5 * F.logsigmoid(-beta * a) - 0.5 * F.logsigmoid(-beta * b)
    elif kind == "bco_pair":  # BCO (Jung et al. 2024) on pairs: each reward classified against the running mean
        losses = -F.logsigmoid(beta * a - delta) - F.logsigmoid(-(beta * b - delta))
    elif kind == "sppo_hard":  # SPPO with hard probabilities (Wu et al. 2024)
        losses = (a - 0.5 / beta) ** 2 + (b + 0.5 / beta) ** 2
    elif kind in ("aot", "aot_pair"):  # AOT (Melnyk et al. 2024): sorted across the micro-batch's pairs
        if kind == "aot":
            d = torch.sort(chosen - rejected)[0] - torch.sort(ref_chosen - ref_rejected)[0]
        else:
            d = torch.sort(a)[0] - torch.sort(b)[0]
        losses = smoothed(d)
    elif kind == "apo_zero":  # APO (D'Oosterlinck et al. 2024, eq. 7): chosen outputs better than the model's own
        losses = 1 - torch.sigmoid(beta * a) + torch.sigmoid(beta * b)
    elif kind == "apo_down":  # APO eq. 8: chosen outputs worse than the model's own
        losses = torch.sigmoid(beta * a) + 1 - torch.sigmoid(beta * h)
    elif kind == "discopop":  # DiscoPOP (Chris Lu et al. 2024, eq. 5): logistic and exponential, blended
        z = beta * h
        blend = torch.sigmoid(z / loss.discopop_tau)
        losses = -F.logsigmoid(z) * (1 - blend) + torch.exp(-z) * blend
    else:
        losses = smoothed(h)
    return losses, (beta * a).detach(), (beta * b).detach()


@contextlib.contextmanager
def as_reference(module):
    """The model as it started: its LoRA adapters disabled, in eval mode (no dropout), for one pass."""
    training = module.training
    module.eval()
    try:
        with module.disable_adapter():
            yield module
    finally:
        module.train(training)


def frozen_reference(spec, ds_config: dict, *, vocab_size: int, eos_id: int, pad_id: int, seed: int, device, dtype):
    """Full fine-tuning's reference: the model `spec` starts from, built again (the same `model` and `seed`: the same
    weights) without adapters or gradient checkpointing, frozen, in eval mode and in `dtype` (the
    precision the trained model computes in). At ZeRO-3 (`ds_config`'s stage) it is built partitioned and wrapped in
    a DeepSpeed engine without an optimizer (`reference_deepspeed_config`), which gathers each layer for its
    forward; at stages 0-2 it is whole on `device` (the CPU when None). Every rank calls this: both builds are
    collective."""
    import deepspeed
    import torch

    from pylon.jobs.deepspeed_config import reference_deepspeed_config
    from pylon.models import build_model

    plain = spec.model_copy(update={"lora": None, "gradient_checkpointing": False})  # (chunked as the model is)
    model = build_model(
        plain, vocab_size=vocab_size, eos_id=eos_id, pad_id=pad_id, seed=seed, deepspeed_config=ds_config, device=device
    )
    model.requires_grad_(False)
    if ds_config["zero_optimization"]["stage"] == 3:
        model, *_ = deepspeed.initialize(model=model, config=reference_deepspeed_config(ds_config))
    else:
        model.to(device=device or torch.device("cpu"), dtype=dtype)
    model.eval()  # (a DeepSpeed engine's returns None)
    return model


def completion_logprobs(model, args: dict, labels, positions, loss: DpoLoss) -> tuple:
    """`model`'s log-probability of each completion (summed, or its tokens' mean: `loss.mean`) with how many each
    row holds (`pair_up`'s arguments), each completion's mean token log-probability (RPO's NLL, `loss.rpo_alpha`;
    else None), and the model's output. Under `loss_chunk_tokens` (`loss.chunked`) the model gives the counted
    tokens' log-probabilities a chunk at a time (`pylon.models.with_chunked_loss`): no whole logits."""
    if loss.chunked:
        out = model(**args, labels=labels, token_logprobs=True)
        token_lp = out.token_logprobs
    else:
        out = model(**args)
        token_lp = counted_logprobs(out.logits, labels)
    sums, counts, per_row = _sums_and_counts(token_lp, labels, positions)
    means = sums / counts
    return ((means if loss.mean else sums), per_row), (means if loss.rpo_alpha else None), out


def reference_logprobs(reference, module, args: dict, labels, positions, loss: DpoLoss) -> tuple:
    """The reference's `completion_logprobs`, without gradients: `reference` the frozen copy (`frozen_reference`),
    or None: `module` (a peft model) with its adapters disabled."""
    import torch

    with torch.no_grad():
        if reference is not None:
            return completion_logprobs(reference, args, labels, positions, loss)[0]
        with as_reference(module):
            return completion_logprobs(module, args, labels, positions, loss)[0]


def dpo_forward(
    model,
    module,
    inputs: dict,
    loss: DpoLoss,
    where: str,
    model_inputs,
    reference=None,
    running=None,
    update=True,
    precomputed=None,
) -> tuple:
    """One micro-batch: the reference's pass (no gradients; `reference` the frozen copy, or None: `module` with its
    adapters disabled; none for SimPO and ORPO; none either with `precomputed`, its values for these rows read from a
    `pylon.jobs.reference_cache.ReferenceTable`), then `model`'s (the DeepSpeed engine: the pass that is trained).
    `running` (dpo_loss bco_pair's `RunningMean`): updated with this micro-batch's rewards on every rank (`update`;
    an evaluation reads it as it stands). Returns (the pairs' summed loss as a tensor, pairs, counted tokens, [chosen
    rewards' sum, rejected rewards' sum, pairs whose chosen reward is larger], the model's output)."""
    import torch

    args = model_inputs(inputs)
    labels = inputs["labels"]
    # (an all-padding row, `train._padding_batch`, has no position_ids and counts no token: no pair)
    positions = inputs.get("position_ids", torch.zeros_like(labels))
    ref_chosen = ref_rejected = None
    if precomputed is not None:
        ref_chosen, ref_rejected = pair_up(*precomputed, where)
    elif loss.needs_reference:
        ref_chosen, ref_rejected = pair_up(*reference_logprobs(reference, module, args, labels, positions, loss), where)
    if loss.scores:  # a reward model: its head at each completion's last token
        from pylon.models import head_outputs

        with head_outputs(module) as heads:
            out = model(**args)
        eos = getattr(module.config, "eos_token_id", None)
        rewards = document_rewards(heads[-1][..., 0], labels, positions, eos, loss.conversations)
        chosen, rejected = pair_up(*rewards, where)
    else:
        logprobs, means, out = completion_logprobs(model, args, labels, positions, loss)
        chosen, rejected = pair_up(*logprobs, where)
    delta = 0.0
    if loss.bco:  # the rewards' running mean, this micro-batch's (every rank's) included
        if running is None:
            raise ValueError("dpo_loss bco_pair needs its RunningMean")
        if update:
            rewards = loss.beta * torch.cat([chosen - ref_chosen, rejected - ref_rejected]).detach()
            running.update(rewards.mean() if rewards.numel() else None)
        delta = running.mean
    losses, chosen_rewards, rejected_rewards = dpo_losses(chosen, rejected, ref_chosen, ref_rejected, loss, delta)
    if loss.rpo_alpha:  # RPO: the chosen completion's NLL (its tokens' mean) too
        losses = losses - loss.rpo_alpha * pair_up(means, logprobs[1], where)[0]
    # one read from the device for the figures: rewards' sums, correct pairs, counted tokens
    *stats, tokens = torch.stack(
        [
            chosen_rewards.sum(),
            rejected_rewards.sum(),
            (chosen_rewards > rejected_rewards).sum().float(),
            (labels[:, 1:] != -100).sum().float(),
        ]
    ).tolist()
    return losses.sum(), int(losses.numel()), int(tokens), stats, out


def dpo_record(
    loss_sum: float, pairs: float, chosen: float, rejected: float, correct: float, prefix: str = "", name: str = "dpo"
) -> dict:
    """The preference figures of a step or an evaluation (`prefix` "val_" for one) under the objective's `name`, from
    the sums over its pairs."""
    n = max(pairs, 1.0)
    p = f"{prefix}{name}_"
    # (a reward model's: reward_chosen, reward_margin; the others': dpo_rewards_chosen, dpo_reward_margin)
    rewards, reward = (p, p) if name == "reward" else (f"{p}rewards_", f"{p}reward_")
    return {
        f"{p}loss": loss_sum / n,
        f"{p}pairs": int(pairs),
        f"{rewards}chosen": chosen / n,
        f"{rewards}rejected": rejected / n,
        f"{reward}margin": (chosen - rejected) / n,
        f"{reward}accuracy": correct / n,
    }
