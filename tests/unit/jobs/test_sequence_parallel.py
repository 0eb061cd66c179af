"""`scaling.sequence_parallel` (`pylon.jobs.sequence_parallel`, DeepSpeed's Ulysses): two ranks on gloo compute each
row's halves and get the whole row's loss, logits and gradients (`sequence_parallel_ranks.py`, one process a rank);
the slices each rank gets, and what is refused, naming the field. End to end through Ray Train and DeepSpeed:
tests/integration/test_train_sequence_parallel.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from pylon.errors import PylonError
from pylon.jobs import sequence_parallel
from pylon.jobs.sequence_parallel import SequenceParallel
from pylon.specs import TrainJobSpec

HELPER = Path(__file__).with_name("sequence_parallel_ranks.py")
CASES = [
    "llama-gqa",
    "llama-mqa-documents",
    "mistral-window",
    "mistral-window-documents",
    "gpt2",
    "llama-chunked-loss",
    "llama-checkpointing",
]


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(HELPER), str(port)], capture_output=True, text=True, timeout=600, env=env
    )
    assert done.returncode == 0, done.stderr[-4000:]
    results = [json.loads(line[len("RESULT ") :]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return {r["case"]: r for r in results}


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_compute_what_one_process_does(two_ranks, case) -> None:
    """Each case's loss over the two halves is the whole rows' (the same tokens counted), every gradient is within
    1e-5 of the whole model's, each rank's logits are its half of the whole rows', and after the scope the model runs
    whole rows as before. Cases: grouped-query attention with a padded row; one key-value head for two ranks
    (repeated) with packed documents, each attended on its own; a sliding window shorter than the row (Mistral), and
    within packed documents; GPT-2 (learned positions,
    layers not handed position_ids); the chunked loss; gradient checkpointing (the all-to-alls again in backward)."""
    r = two_ranks[case]
    assert r["tokens"] == r["reference_tokens"]
    assert r["loss"] == pytest.approx(r["reference_loss"], rel=1e-6)
    assert r["grad_rel_diff"] < 1e-5 and r["grads"] >= 21
    assert r["logit_rel_diff"] < 1e-5
    assert r["after_rel_diff"] < 1e-6


def _sp(rank: int, size: int = 2) -> SequenceParallel:
    return SequenceParallel(size, rank, None, 0, 1)


def test_each_rank_gets_its_tokens_positions_and_the_labels_after_them() -> None:
    ids = torch.arange(16).reshape(2, 8)
    labels = ids.clone()
    labels[1, 6:] = -100
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    first, second = (sequence_parallel.shard(inputs, _sp(k)) for k in (0, 1))
    assert set(first) == {"input_ids", "position_ids", "labels"}  # (no attention_mask: causal over the row)
    assert first["input_ids"].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7], [4, 5, 6, 7]]
    # one label more than tokens: rank 0's last token predicts rank 1's first; the row's last predicts nothing
    assert first["labels"].tolist() == [[0, 1, 2, 3, 4], [8, 9, 10, 11, 12]]
    assert second["labels"].tolist() == [[4, 5, 6, 7, -100], [12, 13, -100, -100, -100]]
    packed = sequence_parallel.shard({**inputs, "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)}, _sp(1))
    assert packed["position_ids"].tolist() == [[1, 2, 3, 4]] * 2  # (a packed row's own, restarting)


def test_documents_are_found_where_positions_restart_and_the_window_masks_within() -> None:
    assert sequence_parallel.documents(torch.arange(8)[None]) is None  # one document a row: sdpa's own causal
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1]])
    assert sequence_parallel.documents(packed) == [[(0, 3), (3, 8)], [(0, 6), (6, 8)]]
    assert sequence_parallel.window_mask(8, None) is None and sequence_parallel.window_mask(8, 8) is None
    window = sequence_parallel.window_mask(8, 3)[0, 0]
    assert window[5].tolist() == [False, False, False, True, True, True, False, False]


def test_a_model_or_row_that_does_not_split_is_refused_naming_the_field() -> None:
    llama = LlamaConfig(num_attention_heads=6, num_key_value_heads=2, hidden_size=48, num_hidden_layers=1)
    sequence_parallel.check(llama, 2, 64, "the model")  # 6 heads, 2 key-value heads: fine for 2
    sequence_parallel.check(llama, 6, 60, "the model")  # 2 key-value heads repeated for 6 ranks
    with pytest.raises(PylonError, match=r"scaling.sequence_parallel 4: the model has 6 attention heads"):
        sequence_parallel.check(llama, 4, 64, "the model")
    with pytest.raises(PylonError, match=r"3 must divide them or be a multiple"):
        sequence_parallel.check(LlamaConfig(num_attention_heads=6, num_key_value_heads=4, hidden_size=48), 3, 60, "m")
    with pytest.raises(PylonError, match=r"the rows are 65 tokens, which do not divide by 2; prepare the data"):
        sequence_parallel.check(llama, 2, 65, "the model")
    eager = GPT2Config(n_head=4)
    eager._attn_implementation = "eager"
    with pytest.raises(PylonError, match=r"attends with transformers' 'eager' implementation"):
        sequence_parallel.check(eager, 2, 64, "model preset gpt-tiny")


def _spec(**over) -> dict:
    spec = {
        "name": "sp",
        "model": {"preset": "llama-tiny"},
        "data": {"uri": "/data"},
        "steps": 4,
        "scaling": {"num_workers": 4, "sequence_parallel": 2},
    }
    return {**spec, **over}


def test_the_spec_refuses_what_sequence_parallelism_cannot_run() -> None:
    assert TrainJobSpec.model_validate(_spec()).scaling.sequence_parallel == 2
    with pytest.raises(ValueError, match=r"scaling.sequence_parallel: must divide scaling.num_workers \(3\)"):
        TrainJobSpec.model_validate(_spec(scaling={"num_workers": 3, "sequence_parallel": 2}))
    with pytest.raises(ValueError, match=r"scaling.sequence_parallel: splits rows for objective causal_lm"):
        TrainJobSpec.model_validate(_spec(objective="dpo"))
    with pytest.raises(ValueError, match=r"neftune_noise_alpha: scales its noise by a row's length"):
        TrainJobSpec.model_validate(_spec(neftune_noise_alpha=5.0))
    with pytest.raises(ValueError, match=r"scaling.sequence_parallel"):
        TrainJobSpec.model_validate(_spec(scaling={"num_workers": 2, "sequence_parallel": 0}))
