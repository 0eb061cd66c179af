"""Kahneman-Tversky optimisation (`TrainJobSpec.objective: kto`; Ethayarajh et al. 2024, TRL's `KTOTrainer`): the
model learns from unpaired feedback, each completion marked desirable or not on its own (a thumbs up or down), with
no pairs and no reward model.

The data is prompt-completion records with a `label` (`pylon data prepare --prompt-completion`, TRL's unpaired
preference format): `{"prompt": ..., "completion": ..., "label": true}`; the label rides beside its document as a
record field (`ShardManifest.record_fields`, `Batch.records`). For a completion y of prompt x, with log pi(y | x) the
summed log-probability of its tokens (and its eos) under the model being trained and log ref(y | x) under the
reference (the model as it started: with `lora` its adapters disabled, else a frozen copy, as objective dpo's):

    r(y) = log pi(y | x) - log ref(y | x)
    z = max(0, mean over the global micro-batch of r(y') for mismatched pairs (x, y'))     (no gradient)
    desirable:   loss = w_d * (1 - sigmoid(beta * (r(y) - z)))
    undesirable: loss = w_u * (1 - sigmoid(beta * (z - r(y))))

averaged over every completion of the global batch (`kto_losses`; TRL's, the paper's eq. 7). z, the KL baseline, is
estimated as TRL estimates it: each prompt of the micro-batch with the completion of the document before it (the
last with the first's), through the model and the reference without gradients (`kl_baseline`), averaged over every
rank's mismatched pairs and floored at 0. At the first step pi is ref, so r = z = 0 and every loss is w / 2.
`kto_loss: apo_zero_unpaired` (APO-zero on unpaired data) has no baseline: desirable 1 - sigmoid(beta r), undesirable
sigmoid(beta r), and no mismatched passes.

Each micro-batch runs, in order: the reference on the documents and on the mismatched pairs, the model on the
mismatched pairs (those three without gradients), then the model on the documents, trained. At ZeRO-3 every rank
runs the same passes (a rank whose data ran out, on padding), as the collective gathering needs.

Logged per step and per evaluation (TRL's figures, under `kto_`): the loss, the desirable and the undesirable
completions' mean rewards beta r(y) and their margin, the KL baseline z, and the share of completions that are
desirable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pylon.data.shards import DataError, split_words
from pylon.errors import PylonError


@dataclass(frozen=True)
class KtoLoss:
    """objective kto's settings (`dpo_beta`, `kto_loss`, `kto_desirable_weight`, `kto_undesirable_weight`,
    `loss_chunk_tokens`)."""

    beta: float = 0.1
    kind: str = "kto"  # or "apo_zero_unpaired"
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    chunked: bool = False

    @classmethod
    def of(cls, spec) -> "KtoLoss":
        return cls(
            beta=spec.dpo_beta,
            kind=spec.kto_loss,
            desirable_weight=spec.kto_desirable_weight,
            undesirable_weight=spec.kto_undesirable_weight,
            chunked=spec.loss_chunk_tokens > 0,
        )

    @property
    def baseline(self) -> bool:
        """Whether the loss has a KL baseline (kto), estimated on mismatched pairs; apo_zero_unpaired has none."""
        return self.kind == "kto"

    @property
    def logprobs(self):
        """How `pylon.jobs.dpo`'s passes read each completion: its tokens' summed log-probability."""
        from pylon.jobs.dpo import DpoLoss

        return DpoLoss(chunked=self.chunked)


# ---------------------------------------------------------------------------------------------------------
# Labels
# ---------------------------------------------------------------------------------------------------------


def _label(record, where: str) -> bool:
    value = (record or {}).get("label")
    if not isinstance(value, bool):
        has = "no label" if value is None else f"label {value!r}"
        raise DataError(
            f"{where}: {has}; objective kto needs each record's label, true (a desirable completion) or false (an "
            "undesirable one): prepare JSONL of prompt, completion and label with `pylon data prepare "
            "--prompt-completion`"
        )
    return value


def document_labels(batch, where: str) -> list[bool]:
    """Each document's label (`Batch.records`), in row order: as `pylon.jobs.dpo`'s passes list the documents. A
    document without a true or false label is a DataError naming `where` (the dataset) and its row."""
    if not len(batch):
        return []
    _, _, starts = split_words(batch.tokens, loss_mask=batch.loss_mask, eos_id=batch.eos_id)
    out = []
    for row in range(len(batch)):
        records = batch.records[row] if batch.records is not None else []
        n = int(starts[row, : int(batch.num_tokens[row])].sum())
        if len(records) != n:
            raise DataError(f"{where}: row {int(batch.sample_ids[row])} holds {n} documents and {len(records)} records")
        out += [_label(r, f"{where}: row {int(batch.sample_ids[row])}, document {k}") for k, r in enumerate(records)]
    return out


def label_counts(uri: str, manifest) -> tuple[int, int]:
    """The dataset's desirable and undesirable completions, every label checked (`_label`): read from its records
    files before any worker starts, so that a record without a label fails the job there, naming its shard's row."""
    from pylon.data.reader import RecordReader

    if "label" not in manifest.record_fields:
        raise PylonError(
            f"objective kto: data.uri {uri} has no `label` field in its records (its fields: "
            f"{', '.join(manifest.record_fields) or 'none'}); prepare JSONL of prompt, completion and label (true: "
            "desirable, false: undesirable) with `pylon data prepare --prompt-completion`"
        )
    reader = RecordReader(uri, manifest, keep=1)
    good = bad = 0
    for shard in manifest.shards:
        if shard.records is None:  # (no record of this shard had a field beside its prompt and completion)
            raise DataError(
                f"data.uri {uri}: shard {shard.file}: no record in it has a label; objective kto needs each record's "
                "label, true (a desirable completion) or false (an undesirable one)"
            )
        ids = np.arange(shard.first_id, shard.first_id + shard.rows)
        for row_id, records in zip(ids.tolist(), reader.rows(ids)):
            for k, record in enumerate(records):
                if _label(record, f"data.uri {uri}: row {row_id}, document {k}"):
                    good += 1
                else:
                    bad += 1
    return good, bad


def balance_note(good: int, bad: int, loss: KtoLoss) -> str:
    """The desirable-to-undesirable weighting of the data, against the KTO paper's advice (1 to 4/3)."""
    if not bad or not good:
        side = "desirable" if not good else "undesirable"
        return f"objective kto: no {side} completion in the data; KTO learns from both"
    ratio = loss.desirable_weight * good / (loss.undesirable_weight * bad)
    line = (
        f"objective kto: {good:,} desirable and {bad:,} undesirable completions; desirable_weight x desirable / "
        f"(undesirable_weight x undesirable) = {ratio:.2f}"
    )
    if not 1.0 <= ratio <= 4 / 3:
        lo, hi = good / bad / (4 / 3), good / bad  # the undesirable weight that puts the ratio at 4/3 and at 1
        line += (
            f", outside the KTO paper's 1 to 4/3: set kto_undesirable_weight to {lo * loss.desirable_weight:.2f}-"
            f"{hi * loss.desirable_weight:.2f}"
        )
    return line


# ---------------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------------


def kto_losses(policy, reference, desirable, kl, loss: KtoLoss) -> tuple:
    """Each completion's loss (the desirable ones', then the undesirable ones', each weighted), and the desirable
    and undesirable completions' rewards beta (log pi - log ref), as TRL's `kto_loss` writes them. `policy`,
    `reference`: each completion's summed log-probability; `desirable`: [completions] bool; `kl`: the baseline z (a
    tensor, no gradient)."""
    import torch

    ratio = policy - reference
    chosen, rejected = ratio[desirable], ratio[~desirable]
    if loss.baseline:
        chosen_losses = 1 - torch.sigmoid(loss.beta * (chosen - kl))
        rejected_losses = 1 - torch.sigmoid(loss.beta * (kl - rejected))
    else:  # apo_zero_unpaired
        chosen_losses = 1 - torch.sigmoid(loss.beta * chosen)
        rejected_losses = torch.sigmoid(loss.beta * rejected)
    losses = torch.cat([loss.desirable_weight * chosen_losses, loss.undesirable_weight * rejected_losses])
    return losses, loss.beta * chosen.detach(), loss.beta * rejected.detach()


def mismatched_pairs(batch, eos_id: int, pad_id: int, device) -> tuple[dict, int]:
    """The KL baseline's inputs: each document's prompt with the completion (eos included) of the document before
    it in the micro-batch, the first's with the last's (TRL's `_get_kl_dataset`), as right-padded rows whose labels
    count the completion; and how many there are. A micro-batch of one document pairs it with itself."""
    from pylon.jobs.grpo import completion_batch, prompts_and_answers

    docs = prompts_and_answers(batch, eos_id, whole=True) if len(batch) else []
    prompts = [p for p, _, _ in docs]
    completions = [c for _, c, _ in docs]
    return completion_batch(prompts, completions[-1:] + completions[:-1], pad_id, device), len(docs)


def kl_baseline(model, module, reference, inputs: dict, n: int, loss: KtoLoss):
    """z: the mean over every rank's mismatched pairs (`mismatched_pairs`) of log pi - log ref, floored at 0, without
    gradients; the reference `reference` (the frozen copy) or None (`module` with its adapters disabled)."""
    import torch
    import torch.distributed as dist

    from pylon.jobs.grpo import reference_logprobs, token_logprobs

    with torch.no_grad():
        ref = reference_logprobs(model, reference, inputs, loss.chunked, owner=module)
        lp, _ = token_logprobs(model, inputs, loss.chunked)
        total = (lp - ref).sum()  # (the pairs' summed log-ratios: every counted token's, whichever its row)
        sums = torch.stack([total.double(), torch.tensor(float(n), dtype=torch.float64, device=total.device)])
        if dist.is_initialized():
            dist.all_reduce(sums)
        return (sums[0] / sums[1].clamp(min=1.0)).clamp(min=0.0).float()


def kto_forward(
    model, module, inputs: dict, batch, loss: KtoLoss, where: str, model_inputs, reference, *, eos_id: int, pad_id: int
) -> tuple:
    """One micro-batch (`batch`, and its model inputs `inputs`): the reference's pass over its documents, the KL
    baseline's passes (kto), then `model`'s (the DeepSpeed engine: the pass that is trained). Returns (the completions'
    summed loss as a tensor, completions, counted tokens, [desirable rewards' sum, undesirable rewards' sum, desirable
    completions, undesirable completions, the baseline z], the model's output)."""
    import torch

    from pylon.jobs.dpo import completion_logprobs, reference_logprobs

    args = model_inputs(inputs)
    labels = inputs["labels"]
    positions = inputs.get("position_ids", torch.zeros_like(labels))
    desirable = torch.as_tensor(document_labels(batch, where), dtype=torch.bool, device=labels.device)
    ref, _ = reference_logprobs(reference, module, args, labels, positions, loss.logprobs)
    kl = torch.zeros((), device=labels.device)
    if loss.baseline:
        pairs, n = mismatched_pairs(batch, eos_id, pad_id, labels.device)
        kl = kl_baseline(model, module, reference, pairs, n, loss)
    (policy, _), _, out = completion_logprobs(model, args, labels, positions, loss.logprobs)
    if policy.numel() != desirable.numel():
        raise DataError(f"{where}: {policy.numel()} completions read, {desirable.numel()} labels")
    losses, chosen, rejected = kto_losses(policy, ref, desirable, kl, loss)
    *stats, tokens = torch.stack(
        [
            chosen.sum(),
            rejected.sum(),
            desirable.sum().float(),
            (~desirable).sum().float(),
            kl.float(),
            (labels[:, 1:] != -100).sum().float(),
        ]
    ).tolist()
    return losses.sum(), int(losses.numel()), int(tokens), stats, out


def kto_record(
    loss_sum: float, completions: float, chosen: float, rejected: float, n_chosen: float, n_rejected: float,
    kl_sum: float, passes: float, prefix: str = "",
) -> dict:  # fmt: skip
    """The figures of a step or an evaluation (`prefix` "val_" for one) from the sums over its completions and
    micro-batches (`passes`: the micro-batches' count over every rank, each holding the same baseline z)."""
    p = f"{prefix}kto_"
    good = chosen / n_chosen if n_chosen else 0.0
    bad = rejected / n_rejected if n_rejected else 0.0
    return {
        f"{p}loss": loss_sum / max(completions, 1.0),
        f"{p}completions": int(completions),
        f"{p}rewards_chosen": good,
        f"{p}rewards_rejected": bad,
        f"{p}reward_margin": good - bad,
        f"{p}kl": kl_sum / max(passes, 1.0),
        f"{p}desirable_share": n_chosen / max(completions, 1.0),
    }
