"""pylon.serving.model.lora and ModelRunner(adapters=...): many peft LoRA adapters served at once on one base model.

Tiny random GPT-2 and Llama models and adapters made by peft itself (`init_lora_weights=False`, so that B is not
zero), saved with `save_pretrained`. A mixed step (base rows, two adapters, prompt chunks, decodes, a sequence asking
for its prompt's logits) must give, per sequence, the logits `PeftModel.from_pretrained(base, adapter)` (or the base
model) gives on the same tokens; for the plain, the oneDNN (packed, padded rows) and the int8 projections. Adapters
the engine cannot serve as they are must be refused naming the directory and what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from pylon.errors import PylonError
from pylon.serving.model import linear, quant
from pylon.serving.model.graphs import DecodeGraphs
from pylon.serving.model.runner import ModelRunner
from pylon.serving.model.step import StepSequence

# head_dim 32, as in the engine tests' models: the CPU attention kernel's vectorised path.
FAMILIES = {
    "gpt2": {"n_layer": 2, "n_head": 4, "n_embd": 128, "n_positions": 128, "vocab_size": 320},
    "llama": {
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128,
        "vocab_size": 320,
    },
}
# Two adapters a family: attention only (with per-module rank and alpha), and every projection with rsLoRA.
ADAPTERS = {
    "gpt2": (
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["attn.c_attn", "attn.c_proj"],
            rank_pattern={"c_proj": 2},
            alpha_pattern={"h.1.attn.c_attn": 3},
        ),
        dict(r=8, lora_alpha=4, target_modules=["c_attn", "c_proj", "c_fc"], use_rslora=True),
    ),
    "llama": (
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            rank_pattern={"o_proj": 2},
            alpha_pattern={"layers.1.self_attn.v_proj": 3},
        ),
        dict(
            r=8,
            lora_alpha=4,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            use_rslora=True,
        ),
    ),
}
# The mixed batch: (adapter, prompt length) per sequence, and three steps of (sequence, tokens, prompt_logits),
# each computing the sequence's next tokens. Step 1: whole prompts, one of them asking for its prompt's logits, and a
# first chunk that does not finish its prompt (no logits); step 2: the rest of that prompt among decodes; step 3:
# decodes only (the path where the last layer keeps every row).
SEQUENCES = [(0, 21), (1, 13), (2, 30), (2, 7), (0, 9)]
STEPS = [
    [(0, 21, False), (1, 8, False), (2, 30, True), (3, 7, False), (4, 9, False)],
    [(0, 1, False), (1, 5, False), (2, 1, False), (3, 1, False), (4, 1, False)],
    [(0, 1, False), (1, 1, False), (2, 1, True), (3, 1, False), (4, 1, False)],
]
EXTRA = 2  # decoded tokens a sequence gets after its prompt (steps 2 and 3)
BLOCK_SIZE = 16
TOLERANCE = 1e-4


def _config(name: str, **overrides):
    # initializer_range 0.2: logits of a few units, so that a missing delta shows far above the tolerance.
    return AutoConfig.for_model(name, **{**FAMILIES[name], **overrides}, initializer_range=0.2)


def _save_base(name: str, directory: Path, **overrides) -> Path:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(_config(name, **overrides), dtype=torch.float32).save_pretrained(directory)
    return directory


def _save_adapter(base_dir: Path, directory: Path, seed: int = 1, **lora) -> Path:
    """An adapter peft makes on the base in `base_dir`, with A and B random (B is zeros by default)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(init_lora_weights=False, **lora)).save_pretrained(directory)
    return directory


class Family:
    """A saved base model, two saved adapters of it, and the tokens of `SEQUENCES` with the reference logits at
    every position of each: the base model's for adapter 0, peft's for adapter k."""

    def __init__(self, name: str, root: Path):
        self.name = name
        self.base_dir = _save_base(name, root / "base")
        self.adapter_dirs = [
            _save_adapter(self.base_dir, root / f"adapter{k}", seed=k, **lora)
            for k, lora in enumerate(ADAPTERS[name], start=1)
        ]
        g = torch.Generator().manual_seed(2)
        self.tokens = [torch.randint(0, 320, (n + EXTRA,), generator=g).tolist() for _, n in SEQUENCES]
        models = self.reference_models()
        self.reference = self.logits(models)
        # The effect of each adapter on its sequences' logits: far above TOLERANCE, or the parity would prove nothing.
        for i, (adapter, base) in enumerate(zip(SEQUENCES, self.logits(models, only=0))):
            if adapter[0]:
                effect = (self.reference[i] - base).abs().max().item()
                assert effect > 100 * TOLERANCE, (name, adapter, effect)

    def reference_models(self, base_weights=None) -> list[torch.nn.Module]:
        """The base model, then peft's model of each adapter on a fresh copy of it; `base_weights(model)` changes
        each base first (the int8 test's dequantized weights)."""
        models = []
        for k in range(len(self.adapter_dirs) + 1):
            model = AutoModelForCausalLM.from_pretrained(self.base_dir, dtype=torch.float32)
            if base_weights is not None:
                base_weights(model)
            if k:
                model = PeftModel.from_pretrained(model, str(self.adapter_dirs[k - 1]))
            models.append(model.eval())
        return models

    def logits(self, models: list[torch.nn.Module], only: int | None = None) -> list[torch.Tensor]:
        """`[positions, vocab]` logits of each sequence over its whole tokens, by its adapter's model (or `only`'s)."""
        with torch.no_grad():
            return [
                models[adapter if only is None else only](torch.tensor([tokens])).logits[0].float()
                for (adapter, _), tokens in zip(SEQUENCES, self.tokens)
            ]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(request.param))


def _runner(family: Family, **kwargs) -> ModelRunner:
    return ModelRunner(
        str(family.base_dir),
        num_blocks=24,
        block_size=BLOCK_SIZE,
        device="cpu",
        dtype="fp32",
        adapters=[str(d) for d in family.adapter_dirs],
        **kwargs,
    )


def _table(i: int) -> list[int]:
    """Sequence i's blocks, by hand: three each (48 tokens), no two sequences sharing one, out of order."""
    return [14 - i, i, 19 + i]


def _run_mixed(runner: ModelRunner, family: Family) -> list[tuple[int, int, torch.Tensor]]:
    """`STEPS` through `runner`: (sequence, position, logits) of every row it returned."""
    done = [0] * len(SEQUENCES)
    got = []
    for step in STEPS:
        seqs, wanted = [], []
        for i, n, prompt_logits in step:
            start = done[i]
            samples = start + n >= SEQUENCES[i][1]  # a chunk that ends before the prompt does samples nothing
            seqs.append(
                StepSequence(
                    family.tokens[i][start : start + n],
                    start,
                    _table(i),
                    samples,
                    prompt_logits=prompt_logits,
                    adapter=SEQUENCES[i][0],
                )
            )
            if prompt_logits:
                wanted.extend((i, p) for p in range(start, start + n))
            elif samples:
                wanted.append((i, start + n - 1))
            done[i] += n
        logits = runner.execute(seqs)
        assert logits.shape == (len(wanted), 320)
        got.extend((i, p, row) for (i, p), row in zip(wanted, logits))
    return got


def _assert_matches(got, reference: list[torch.Tensor], tolerance: float = TOLERANCE) -> None:
    seen_adapters = set()
    for i, p, row in got:
        err = (row - reference[i][p]).abs().max().item()
        assert err < tolerance, f"sequence {i} (adapter {SEQUENCES[i][0]}) at position {p}: off by {err:.2e}"
        seen_adapters.add(SEQUENCES[i][0])
    assert seen_adapters == {0, 1, 2}


@pytest.mark.parametrize("projections", ["packed", "plain"])
def test_a_mixed_step_gives_each_sequence_its_adapters_logits(family: Family, projections: str, monkeypatch) -> None:
    """Base rows and two adapters' rows in the same steps (prompt chunks, decodes, prompt logits, padding rows)
    give what peft's model of each adapter gives on the same tokens, over oneDNN's packed weights or torch's."""
    if projections == "plain":
        monkeypatch.setenv("PYLON_ONEDNN_LINEAR", "0")
    elif not linear.usable(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no usable oneDNN")
    runner = _runner(family)
    assert runner.packed_linear == runner.pad_rows == (projections == "packed")  # padded rows: base rows too
    assert len(runner.adapter_set) == 2
    _assert_matches(_run_mixed(runner, family), family.reference)


def test_int8_projections_take_the_adapters_too(family: Family) -> None:
    """With int8 base weights, each sequence's logits are those of peft's model over the dequantized base weights
    (what the int8 projection computes), to float rounding: the adapters' deltas are added to the int8 outputs."""

    def dequantize(model) -> None:
        for module in model.modules():
            if type(module).__name__ == "Conv1D":  # GPT-2's [in, out] weight
                module.weight.data = quant.QuantWeight(module.weight.data.t()).dequantized(torch.float32).t()
            elif isinstance(module, torch.nn.Linear) and module is not model.get_output_embeddings():
                module.weight.data = quant.QuantWeight(module.weight.data).dequantized(torch.float32)

    runner = _runner(family, quantization="int8")
    reference = family.logits(family.reference_models(base_weights=dequantize))
    _assert_matches(_run_mixed(runner, family), reference)


def test_a_step_without_adapter_rows_is_the_plain_runners_step(family: Family) -> None:
    """Sequences of adapter 0 on a runner with adapters compute exactly what a runner without any computes; the
    adapters' bytes are A and B of each adapted projection, in the runner's dtype."""
    with_adapters = _runner(family)
    plain = ModelRunner(str(family.base_dir), num_blocks=24, block_size=BLOCK_SIZE, device="cpu", dtype="fp32")
    assert (plain.adapter_bytes, plain.adapter_set) == (0, None)
    for start, n in ((0, 21), (21, 1)):
        step = [StepSequence(family.tokens[0][start : start + n], start, _table(0), True)]
        assert torch.equal(with_adapters.execute(step), plain.execute(step))
    # lora_A [r, in] and lora_B [out, r] of each adapted module, float32
    elements = sum(t.numel() for d in family.adapter_dirs for t in _safetensors(d).values())
    assert with_adapters.adapter_bytes == 4 * elements


def test_decode_graphs_run_base_steps_only(family: Family) -> None:
    """A decode step of adapter 0 only replays a fixed-shape decode graph (here run eagerly, as on a CPU test); one
    with an adapter's sequence runs eagerly, with the adapter's logits."""
    runner = _runner(family)
    runner.add_scratch_block()
    runner.decode_graphs = DecodeGraphs(runner, 4, 48, capture=False)
    runner.decode_graphs.capture_all()
    replays = runner.decode_graphs.replays
    prompt = [StepSequence(family.tokens[i][:-EXTRA], 0, _table(i), True, adapter=SEQUENCES[i][0]) for i in (0, 1, 4)]
    runner.execute(prompt)

    def decode(seqs: tuple[int, ...]) -> torch.Tensor:
        """Each of `seqs` one token past its prompt, and the logits there, checked against the reference's."""
        steps = []
        for i in seqs:
            adapter, n = SEQUENCES[i]
            steps.append(StepSequence([family.tokens[i][n]], n, _table(i), True, adapter=adapter))
        logits = runner.execute(steps)
        for row, i in zip(logits, seqs):
            assert (row - family.reference[i][SEQUENCES[i][1]]).abs().max() < TOLERANCE
        return logits

    decode((0, 1))  # the base model's sequence 0 and adapter 1's sequence 1: eagerly
    assert runner.decode_graphs.replays == replays
    decode((4,))  # the base model's alone: a graph
    assert runner.decode_graphs.replays == replays + 1


def test_an_adapter_slot_the_runner_does_not_have_is_refused(family: Family) -> None:
    runner = _runner(family)
    with pytest.raises(ValueError, match=r"StepSequence\.adapter 3: this runner serves adapters in slots \[1, 2\]"):
        runner.execute([StepSequence([1, 2], 0, _table(0), True, adapter=3)])


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(Path(directory) / "adapter_model.safetensors")


def _edited(source: Path, target: Path, **fields) -> Path:
    """A copy of the adapter in `source` whose adapter_config.json has `fields` set."""
    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return target


def _refused(family: Family, adapter: Path, match: str) -> None:
    with pytest.raises(PylonError, match=match) as e:
        ModelRunner(str(family.base_dir), num_blocks=4, block_size=BLOCK_SIZE, device="cpu", adapters=[str(adapter)])
    assert str(e.value).startswith(f"{adapter}: "), str(e.value)


def test_missing_adapter_files_are_refused(family: Family, tmp_path: Path) -> None:
    _refused(family, tmp_path / "nowhere", r"no such LoRA adapter directory; give the directory peft's save_pretrained")
    (tmp_path / "empty").mkdir()
    _refused(family, tmp_path / "empty", r"not a LoRA adapter \(no adapter_config.json\)")
    no_weights = _edited(family.adapter_dirs[0], tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    _refused(family, no_weights, r"no weights \(adapter_model.safetensors or adapter_model.bin\); copy the whole")
    truncated = _edited(family.adapter_dirs[0], tmp_path / "truncated")
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    _refused(family, truncated, r"adapter_model.safetensors cannot be read .*copy or write the adapter again")


def test_an_adapter_saved_as_bin_is_read_too(family: Family, tmp_path: Path) -> None:
    as_bin = _edited(family.adapter_dirs[1], tmp_path / "bin")
    torch.save(_safetensors(as_bin), as_bin / "adapter_model.bin")
    (as_bin / "adapter_model.safetensors").unlink()
    runner = ModelRunner(str(family.base_dir), num_blocks=24, block_size=BLOCK_SIZE, device="cpu", adapters=[as_bin])
    assert runner.adapter_bytes == _runner(family).adapter_set.adapters[1].nbytes
    step = [StepSequence(family.tokens[2][:9], 0, _table(2), True, adapter=1)]  # sequence 2 is adapter 2's
    assert (runner.execute(step)[0] - family.reference[2][8]).abs().max() < TOLERANCE


def test_adapters_the_engine_cannot_apply_are_refused_saying_what_to_do(family: Family, tmp_path: Path) -> None:
    attention = ["c_attn"] if family.name == "gpt2" else ["q_proj"]
    merge = r"merge it into its base model instead \(`pylon export --lora merged`"
    dora = _save_adapter(family.base_dir, tmp_path / "dora", r=4, target_modules=attention, use_dora=True)
    _refused(family, dora, rf"a DoRA adapter \(use_dora: true\).*{merge}")
    bias = _save_adapter(family.base_dir, tmp_path / "bias", r=4, target_modules=attention, bias="lora_only")
    _refused(family, bias, r"trains the base model's biases too \(bias: 'lora_only'\).*retrain with bias 'none'")
    saved = _edited(family.adapter_dirs[0], tmp_path / "saved", modules_to_save=["lm_head"])
    _refused(family, saved, r"replaces whole modules \(modules_to_save: \['lm_head'\]\).*retrain without")
    ia3 = _edited(family.adapter_dirs[0], tmp_path / "ia3", peft_type="IA3")
    _refused(family, ia3, rf"a IA3 adapter \(peft_type 'IA3'\); the serving engine applies LoRA adapters only: {merge}")
    pissa = _edited(family.adapter_dirs[0], tmp_path / "pissa", init_lora_weights="pissa")
    _refused(family, pissa, r"initialised with 'pissa', which changed the base weights.*path_initial_model_for")
    lm_head = _save_adapter(family.base_dir, tmp_path / "lm_head", r=4, target_modules=[*attention, "lm_head"])
    _refused(
        family, lm_head, rf"changes lm_head, which the serving engine does not adapt \(it applies LoRA to .*{merge}"
    )


def test_an_adapter_of_another_base_is_refused_naming_module_and_shapes(family: Family, tmp_path: Path) -> None:
    wider = {"n_embd": 64} if family.name == "gpt2" else {"hidden_size": 64}
    other = _save_base(family.name, tmp_path / "other", **wider)
    target = "c_attn" if family.name == "gpt2" else "q_proj"
    adapter = _save_adapter(other, tmp_path / "other-adapter", r=4, target_modules=[target])
    module, shapes = (
        ("transformer.h.0.attn.c_attn", r"lora_A is \[4, 64\] and lora_B \[192, 4\].* maps 128 inputs to 384 outputs")
        if family.name == "gpt2"
        else (
            "model.layers.0.self_attn.q_proj",
            r"lora_A is \[4, 64\] and lora_B \[64, 4\].* maps 128 inputs to 128 outputs",
        )
    )
    _refused(family, adapter, rf"{module}: {shapes}.*trained on another base model: serve it with that one")
    deeper = {"n_layer": 3} if family.name == "gpt2" else {"num_hidden_layers": 3}
    other = _save_base(family.name, tmp_path / "deeper", **deeper)
    adapter = _save_adapter(other, tmp_path / "deeper-adapter", r=4, target_modules=[target])
    layer = "transformer.h.2.attn.c_attn" if family.name == "gpt2" else "model.layers.2.self_attn.q_proj"
    _refused(family, adapter, rf"adapts {layer}, but this model has 2 layers \(0 to 1\)")
