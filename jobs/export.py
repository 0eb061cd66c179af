"""`pylon export RUN_URI --out DIR`: the latest committed checkpoint of a run as one Hugging Face model.

ZeRO shards (stages 1-3: partitioned optimizer states, and for stage 3 partitioned parameters) are
consolidated with DeepSpeed's own `zero_to_fp32` into full fp32 weights, loaded into the run's model and
saved as safetensors with its config, plus `pylon_tokenizer.json`, the tokenizer identity the model was
trained with. LoRA runs export merged weights or the adapter alone, as the spec says. When the run evaluated
the exported step on held-out data (`data.validation_fraction` > 0: always its last step), `eval.json` beside
the weights holds that evaluation: loss, perplexity, tokens, and the dataset and validation ids it covered.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from pylon import storage
from pylon.errors import PylonError

TOKENIZER_FILE = "pylon_tokenizer.json"
EVAL_FILE = "eval.json"


def export_run(
    run_uri: str, out: str, *, step: int | None = None, lora: str | None = None, moved: dict | None = None
) -> str:
    """Export `run_uri`'s latest (or `step`'s) committed checkpoint to `out`; returns `out`.

    `lora` ("merged" or "adapter") overrides the spec's `lora.merge_on_export` for a LoRA run. `moved`, when
    given, gets the bytes read (the checkpoint's files) and written (the export's), for the run's ledger."""
    from pylon.jobs.checkpoint import download, list_committed
    from pylon.models import build_model, export_lora
    from pylon.specs import TrainJobSpec

    run_file = storage.join(run_uri, "run.json")
    if not storage.exists(run_file):
        raise PylonError(
            f"{run_uri}: not a Pylon run (no run.json); give the run directory, e.g. "
            "~/.pylon/runs/<name> or s3://bucket/runs/<name>"
        )
    run = storage.read_json(run_file)
    spec = TrainJobSpec.model_validate(run["spec"])
    tokenizer = run["tokenizer"]
    if lora not in (None, "merged", "adapter"):
        raise PylonError(f"lora: must be 'merged' or 'adapter' (got {lora!r})")
    if lora is not None and spec.lora is None:
        raise PylonError(f"{run_uri}: --lora {lora} given, but run '{spec.name}' is not a LoRA run")
    merge = (lora == "merged") if lora is not None else bool(spec.lora and spec.lora.merge_on_export)
    infos = list_committed(run_uri)
    if not infos:
        raise PylonError(f"{run_uri}: no committed checkpoint yet; nothing to export")
    info = infos[-1] if step is None else next((i for i in infos if i.step == step), None)
    if info is None:
        raise PylonError(
            f"{run_uri}: no committed checkpoint at step {step} (have {', '.join(str(i.step) for i in infos)})"
        )

    with tempfile.TemporaryDirectory(prefix="pylon-export-") as tmp:
        ckpt_dir = str(download(info, os.path.join(tmp, "ckpt")))
        read = sum(p.stat().st_size for p in Path(ckpt_dir).rglob("*") if p.is_file())
        _fill_swapped_master_weights(info, ckpt_dir)
        state = _consolidated_state_dict(ckpt_dir, spec.deepspeed.zero_stage)
        local_out = os.path.join(tmp, "export")
        if spec.objective == "eagle3":  # a drafting head, not a model: the directory the engine's eagle3 reads
            described = _export_eagle3_head(spec, tokenizer, state, local_out)
        else:
            model = build_model(
                spec, vocab_size=tokenizer["vocab_size"], eos_id=tokenizer["eos_id"], pad_id=tokenizer["pad_id"]
            )
            missing, unexpected = model.load_state_dict(state, strict=False)
            trainable_missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
            if trainable_missing or unexpected:
                raise PylonError(
                    f"{run_uri} step {info.step}: checkpoint does not match the model "
                    f"(missing {trainable_missing[:5]}, unexpected {unexpected[:5]})"
                )
            model.eval()
            if spec.lora is not None:
                export_lora(model, local_out, merge=merge)
            else:
                model.config.use_cache = True  # training may have turned it off for gradient checkpointing
                model.save_pretrained(local_out, safe_serialization=True)
            Path(local_out, TOKENIZER_FILE).write_text(json.dumps(tokenizer, indent=2) + "\n")
            write_tokenizer_files(tokenizer, local_out, getattr(model.config, "max_position_embeddings", None))
            described = {"lora_merged": bool(spec.lora and merge)}
        Path(local_out, "pylon_export.json").write_text(
            json.dumps({"run": run_uri, "step": info.step, "name": spec.name, **described}, indent=2) + "\n"
        )
        evaluation = export_eval(run_uri, spec, info.step)
        if evaluation is not None:
            Path(local_out, EVAL_FILE).write_text(json.dumps(evaluation, indent=2) + "\n")
        elif storage.exists(storage.join(out, EVAL_FILE)):  # an earlier export's, of another step
            storage.remove(storage.join(out, EVAL_FILE))
        written = 0
        for path in sorted(Path(local_out).rglob("*")):
            if path.is_file():
                data = path.read_bytes()
                storage.atomic_write(storage.join(out, str(path.relative_to(local_out))), data)
                written += len(data)
    if moved is not None:
        moved.update(read=read, written=written)
    return out


def _export_eagle3_head(spec, tokenizer: dict, state: dict, local_out: str) -> dict:
    """objective eagle3's export: the head in EAGLE-3's layout (pylon.jobs.eagle.export_head) in `local_out`; returns
    what pylon_export.json says of it (the model it drafts for)."""
    from pylon.jobs.eagle import export_head
    from pylon.models import model_config

    config = model_config(
        spec.model, vocab_size=tokenizer["vocab_size"], eos_id=tokenizer["eos_id"], pad_id=tokenizer["pad_id"]
    )
    export_head(state, spec, config, local_out)
    return {"objective": "eagle3", "drafts_for": spec.model.path}


def export_eval(run_uri: str, spec, step: int) -> dict | None:
    """What `eval.json` holds for an export of `step`: the run's held-out evaluation of exactly that step
    (`"kind": "eval"` records of metrics.jsonl, which the trainer writes before that step's checkpoint), with
    the data it covered; None when that step was not evaluated (no validation split, or a step in between)."""
    from pylon.jobs.run_dir import read_metrics

    found = [r for r in read_metrics(run_uri, kind="eval") if r["step"] == step]
    if not found:
        return None
    r = found[-1]
    drafts = {k.removeprefix("val_"): v for k, v in r.items() if k.startswith("val_eagle3_")}  # objective eagle3
    if drafts:
        metric = (
            "an EAGLE-3 head's drafts' weighted soft cross-entropy against the model's distribution (nats/drafted "
            "position; tokens: the positions drafted) over the validation split; eagle3_accuracy_k: the share of "
            "draft k's whose top token is the model's; eagle3_accept_length: the drafts a verification would accept"
        )
    elif r["val_perplexity"] is not None:
        metric = "mean next-token cross-entropy (nats/token) over the validation split; perplexity = exp(loss)"
    else:
        metric = (
            "a reward model's mean Bradley-Terry loss over the validation split's preference pairs (tokens: the "
            "pairs; no perplexity)"
        )
    return {
        "step": step,
        "loss": r["val_loss"],
        "perplexity": r["val_perplexity"],
        "tokens": r["val_tokens"],
        "sequences": r["val_sequences"],
        **drafts,
        "metric": metric,
        "dataset": spec.data.uri,
        "split": "validation",
        "validation_fraction": spec.data.validation_fraction,
        "ids": r["val_ids"],  # sample ids [lo, hi): the tail of the dataset's id space
        # how the rows were attended (`pylon eval` attends them the same way); runs before it was recorded: causal
        "attention_mask": r.get("attention_mask", "causal"),
        "max_batches_per_worker": spec.eval.max_batches,
        "workers": spec.scaling.num_workers,
        "run": run_uri,
    }


def read_export_eval(model_dir: str) -> dict | None:
    """An export's `eval.json`, or None when it has none."""
    uri = storage.join(model_dir, EVAL_FILE)
    return storage.read_json(uri) if storage.exists(uri) else None


def write_tokenizer_files(tokenizer: dict, local_out: str, max_length: int | None) -> None:
    """The tokenizer's own files next to the model, as Hugging Face tokenizer files, so the export loads with
    `AutoTokenizer.from_pretrained` and serves without the dataset. The built-in byte tokenizer has none
    (`pylon_tokenizer.json` names it). The files are checked against the fingerprint the dataset recorded:
    a tokenizer changed since would map the model's ids to different text."""
    from tokenizers import Tokenizer as RustTokenizer

    from pylon.data.tokenizer import files_sha256, tokenizer_files

    if tokenizer.get("kind") == "byte":
        return
    uri = tokenizer.get("uri")
    if not uri:
        raise PylonError(
            f"the run was trained with the {tokenizer.get('kind')} tokenizer '{tokenizer.get('name')}', "
            "but its dataset does not record where its files are (prepared before Pylon recorded "
            "it); prepare the dataset again, or copy the tokenizer files into the export yourself"
        )
    is_directory, files = tokenizer_files(uri, f"tokenizer {uri}")
    if files_sha256(files) != tokenizer.get("sha256"):
        raise PylonError(
            f"tokenizer {uri}: its files changed after the dataset was prepared (sha256 differs from "
            "the one the dataset recorded); the model's token ids would decode to different text. "
            "Restore the tokenizer the data was prepared with"
        )
    for rel, data in files:
        target = Path(local_out, rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    if is_directory:
        return
    rust = RustTokenizer.from_str(files[0][1].decode("utf-8"))
    eos, pad = rust.id_to_token(tokenizer["eos_id"]), rust.id_to_token(tokenizer["pad_id"])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eos,
        "eos_token": eos,
        "pad_token": pad,
        "clean_up_tokenization_spaces": False,
    }  # cleaning would glue " ." and " ," in code
    if max_length:
        config["model_max_length"] = int(max_length)
    Path(local_out, "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _fill_swapped_master_weights(info, ckpt_dir: str) -> None:
    """A ZeRO-3 run with its optimizer on NVMe: put the fp32 master weights DeepSpeed left in its swap files back
    into the (downloaded, local) optimizer shards, where `zero_to_fp32` reads them. Each rank's record names its
    swapped sub-groups and their sizes (`jobs.checkpoint.swapped_master_weights`); nothing to do for other runs."""
    import torch

    from pylon.jobs.checkpoint import _read_verified, rank_file_name

    for rank in range(int(info.manifest.get("world_size", 1))):
        record = json.loads(_read_verified(info, rank_file_name(rank)))  # checked against the manifest
        swapped = {entry["ds_id"]: entry for entry in record.get("swapped_master_weights", [])}
        if not swapped:
            continue
        shards = sorted(Path(ckpt_dir, "ds").glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        if len(shards) != 1:
            raise PylonError(f"{info.uri}: rank {rank}'s optimizer shard not found in the checkpoint")
        state = torch.load(shards[0], map_location="cpu", weights_only=False)
        groups = state["optimizer_state_dict"]["fp32_flat_groups"]
        folder = Path(ckpt_dir, "ds", "offloaded_tensors", f"rank{rank:02d}")
        for i, flat in enumerate(groups):
            entry = swapped.get(str(getattr(flat, "ds_id", "")))
            if entry is None or flat.numel():
                continue
            path = folder / f"{entry['ds_id']}.tensor.swp"
            numel = int(entry["numel"])
            if not path.is_file() or path.stat().st_size < numel * 4:
                raise PylonError(
                    f"{info.uri}: rank {rank}'s master weights of optimizer sub-group {i} "
                    f"(offloaded_tensors/rank{rank:02d}/{path.name}) are missing or short"
                )
            groups[i] = torch.from_file(str(path), size=numel, dtype=torch.float32).clone()
        torch.save(state, shards[0])


def _consolidated_state_dict(ckpt_dir: str, zero_stage: int) -> dict:
    """Full fp32 weights from a DeepSpeed checkpoint directory (tag `ds`)."""
    import torch

    if zero_stage == 0:  # no partitioning: rank 0's model states hold every weight
        states = torch.load(
            os.path.join(ckpt_dir, "ds", "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False
        )
        return {k: v.float() for k, v in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag="ds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pylon export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_uri")
    parser.add_argument("--out", required=True)
    parser.add_argument("--step", type=int)
    parser.add_argument("--lora", choices=("merged", "adapter"))
    args = parser.parse_args(argv)
    try:
        print(export_run(args.run_uri, args.out, step=args.step, lora=args.lora))
    except PylonError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
