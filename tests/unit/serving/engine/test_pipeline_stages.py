"""Pipeline stages (engine.pipeline_parallel; pylon.serving.model.stages): each stage's runner loads its own layers
only, and the stages one after another compute what the whole model computes, step for step. Here the stages run in
this process; through Ray actors, in a Serve replica and across hosts: tests/integration (test_serving.py,
test_hosts.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_models import PROMPTS, Family
from safetensors.torch import load_file, save_file

from pylon.errors import PylonError
from pylon.serving.model.runner import ModelRunner
from pylon.serving.model.stages import split_layers, stage_bytes, stage_of, stage_parameters
from pylon.serving.model.step import StepSequence

# Llama; Qwen3 with tied embeddings (the last stage keeps the embedding its lm_head is); Gemma 3 with its windowed and
# full layers by type (7 layers: uneven stages); Mixtral's experts, fused by transformers at load; DeepSeek-V3's latent
# attention and its dense first layer; GPT-OSS's attention sinks, by layer.
# make test: the first three (~25 s); make test-all: all.
SPLIT_FAMILIES = (
    "llama",
    "qwen3",
    "mixtral",
    *(pytest.param(f, marks=pytest.mark.slow) for f in ("gemma3_text", "deepseek_v3", "gpt_oss")),
)


@pytest.fixture(scope="module", params=SPLIT_FAMILIES)
def split_family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp(request.param), greedy=False)


def _runner(family: Family, stage=None) -> ModelRunner:
    return ModelRunner(family.dir, num_blocks=32, block_size=16, dtype="fp32", device="cpu", stage=stage)


def _through(stages: list[ModelRunner], steps: list[StepSequence]) -> torch.Tensor:
    """A step through the stages in turn, its logits made by the first stage's head (as PipelineRunner does)."""
    hidden = None
    for runner in stages:
        hidden, _ = runner.execute_step(steps, hidden)
    # the last stage's rows: the sampling ones only (one a sampling sequence here), not the step's
    assert len(hidden) == sum(s.samples for s in steps), hidden.shape
    return stages[0].finish_step(steps, hidden)[0]


def test_split_layers_is_vllms_rule_and_refuses_more_stages_than_layers():
    assert split_layers(32, 4) == [range(0, 8), range(8, 16), range(16, 24), range(24, 32)]
    # the layers left over go to the last stages (the first holds the embeddings and the head besides)
    assert [len(r) for r in split_layers(7, 3)] == [2, 2, 3]
    assert [len(r) for r in split_layers(32, 3)] == [10, 11, 11]
    assert split_layers(5, 1) == [range(0, 5)]
    with pytest.raises(PylonError, match=r"engine.pipeline_parallel: 5 stages for a model of 4 decoder layers"):
        split_layers(4, 5)


def test_each_stage_holds_its_layers_only_and_together_they_compute_the_whole_model(split_family):
    """Two stages (three for Gemma 3): every stage's weights are the checkpoint's own and only its part (no other
    stage's layer; the embeddings, final norm and lm_head on the first); a chunked prompt and decodes through the
    stages give the whole model's logits, exactly, while each stage keeps its own layers' KV cache; the last stage
    hands back its sampling rows only."""
    family = split_family
    config = family.model.config
    n = config.num_hidden_layers
    count = 3 if n >= 6 else 2
    whole = _runner(family)
    stages = [_runner(family, stage_of(n, k, count)) for k in range(count)]
    checkpoint = family.model.state_dict()
    for k, runner in enumerate(stages):
        own = runner.model.state_dict()
        layers = {int(key.split(".")[2]) for key in own if key.startswith("model.layers.")}
        assert layers == set(split_layers(n, count)[k]), (k, layers)
        assert ("model.embed_tokens.weight" in own) == ("lm_head.weight" in own) == ("model.norm.weight" in own)
        assert ("model.norm.weight" in own) == (k == 0)
        for key, tensor in own.items():
            if key in checkpoint and "experts" not in key:  # (experts: fused at load, checked by the logits)
                assert torch.equal(tensor, checkpoint[key]), key
        # its KV cache: its own layers' blocks only
        assert [len(t) > 0 and t.shape[1] > 0 for t in runner.k_cache] == [i in runner.layers for i in range(n)]
    held = [r.stage_weights_bytes for r in stages]
    assert max(held) < 0.75 * stage_bytes(family.model), (held, stage_bytes(family.model))

    prompt = PROMPTS[2]  # 40 tokens: two chunks, then decodes
    table = [0, 1, 2, 3]
    chunks = [(0, 24), (24, 40)]
    for start, stop in chunks:
        steps = [StepSequence(prompt[start:stop], start, table, samples=stop == len(prompt))]
        a, b = whole.execute(steps), _through(stages, steps)
        assert torch.equal(a, b), (start, (a - b).abs().max())
    tokens = list(prompt)
    for _ in range(6):
        token = int(a[-1].argmax())
        tokens.append(token)
        steps = [StepSequence([token], len(tokens) - 1, table, samples=True)]
        a, b = whole.execute(steps), _through(stages, steps)
        assert torch.equal(a, b), (len(tokens), (a - b).abs().max())
    assert tokens[len(prompt) :] == family.hf_greedy(prompt, 6)


def test_stage_parameters_count_each_stage_as_it_loads(split_family):
    family = split_family
    config = family.model.config
    counts = stage_parameters(config, 2)
    n = config.num_hidden_layers
    for k in range(2):
        runner = _runner(family, stage_of(n, k, 2))
        assert counts[k] * 4 == runner.stage_weights_bytes - _buffer_bytes(runner), (k, counts)


def _buffer_bytes(runner: ModelRunner) -> int:
    """The bytes of a stage's buffers that are not weights (not in its state dict: the rotary embeddings' frequencies,
    Gemma's embedding scale)."""
    persistent = set(runner.model.state_dict())
    return sum(b.numel() * b.element_size() for name, b in runner.model.named_buffers() if name not in persistent)


def _saved(directory, model_type: str, max_shard_size: str | None = None, **fields) -> str:
    """A random model of `model_type` saved (no tokenizer: a runner reads none; in shards of at most
    `max_shard_size`), its directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=320, **fields)
    shards = {"max_shard_size": max_shard_size} if max_shard_size else {}
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, **shards)
    return str(directory)


def _load(directory: str, stage) -> ModelRunner:
    return ModelRunner(directory, num_blocks=4, block_size=16, dtype="fp32", device="cpu", stage=stage)


def test_a_stage_refuses_what_it_cannot_split_and_a_checkpoint_missing_its_weights(tmp_path):
    gpt2 = _saved(tmp_path / "gpt2", "gpt2", n_layer=2, n_head=2, n_embd=32)
    with pytest.raises(PylonError, match=r"engine.pipeline_parallel: model .*: a gpt2 model is not split into stages"):
        _load(gpt2, stage_of(2, 0, 2))
    llama = _saved(
        tmp_path / "llama", "llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    weights = load_file(f"{llama}/model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, f"{llama}/model.safetensors", metadata={"format": "pt"})
    _load(llama, stage_of(2, 0, 2))  # stage 1 holds layer 0: whole
    with pytest.raises(PylonError, match=r"stage 2 of 2 \(layers 1-1\): 1 of its weights are not in the checkpoint "):
        _load(llama, stage_of(2, 1, 2))


def test_stages_of_a_recurrent_model_keep_their_own_layers_states(tmp_path):
    """Qwen3-Next (Gated DeltaNet layers, then attention) in two stages: each keeps its own recurrent layers' state of
    a sequence (stage 1 two layers', stage 2 one's), and together they compute exactly what the whole model does over
    a chunked prompt and decodes; a snapshot of each stage's states, restored into another sequence, continues as
    the first (what the engine's prefix cache does with a split model: engine/split.py's PartsSnapshot)."""
    family = Family("qwen3_next", tmp_path / "qwen3_next", greedy=False)
    whole = _runner(family)
    n = whole.config.num_hidden_layers
    stages = [_runner(family, stage_of(n, k, 2)) for k in range(2)]
    prompt, table = PROMPTS[2], [0, 1, 2, 3]
    tokens, a = list(prompt), None
    for start, stop in ((0, 24), (24, 40), *((k, k + 1) for k in range(40, 46))):
        if a is not None and start >= len(prompt):
            tokens.append(int(a[-1].argmax()))
        steps = [StepSequence(tokens[start:stop], start, table, samples=stop >= len(prompt), state="a")]
        a, b = whole.execute(steps), _through(stages, steps)
        assert torch.equal(a, b), (start, (a - b).abs().max())
    assert tokens[len(prompt) :] == family.hf_greedy(prompt, 6)
    # each stage's own recurrent layers' states only (`[conv, recurrent]` each; the other stage's left empty)
    own = [sum(t is not None for layer in r.snapshot_state("a") for t in layer) for r in stages]
    linear = whole._linear
    assert own == [2 * sum(linear[i] for i in r.layers) for r in stages] and min(own) > 0, own
    # a snapshot of every stage, restored into sequence "b": its next step is sequence "a"'s
    for r in stages:
        r.restore_state("b", r.snapshot_state("a"))
    step = len(tokens) - 1
    one = [StepSequence([tokens[-1]], step, table, samples=True, state="a")]
    other = [StepSequence([tokens[-1]], step, [4, 5, 6, 7], samples=True, state="b")]
    for r in (whole, *stages):  # (b's keys and values: a's blocks copied, as the prefix cache shares them)
        for cache in (*r.k_cache, *r.v_cache):
            if cache.numel():  # ([kv heads, blocks, block size, head dim])
                cache[:, 4:8] = cache[:, 0:4]
    assert torch.equal(_through(stages, one), _through(stages, other))


# Gemma 3 (its text under language_model.model.*, windowed and full layers), Llama 4 (a whole causal LM under
# language_model.*, its experts stored [experts, in, out]), Mistral 3: ~4 s in all.
@pytest.mark.parametrize("name", ["gemma3", "llama4", "mistral3"])
def test_a_multimodal_checkpoint_is_split_into_stages_for_its_text(name, tmp_path):
    """Llama 4 Scout and Maverick, Gemma 3 and Mistral Small 3.1 ship as conditional models (a vision model beside
    the language model): two stages read their language model's layers under its prefix, never the vision model's
    tensors (nor copy them from object storage: `holds`), and compute what the whole runner computes on text; a stage asked for images is refused, naming engine.max_images_per_prompt."""
    import json

    from safetensors import safe_open
    from test_model_families import _multimodal

    from pylon.data.tokenizer import ByteTokenizer
    from pylon.serving.model.stages import holds

    torch.manual_seed(0)
    directory = tmp_path / name
    _multimodal(name)[0].eval().save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(ByteTokenizer().info.model_dump(mode="json")))
    whole = ModelRunner(str(directory), num_blocks=32, block_size=16, dtype="fp32", device="cpu")
    n = whole.config.num_hidden_layers
    stages = [
        ModelRunner(str(directory), num_blocks=32, block_size=16, dtype="fp32", device="cpu", stage=stage_of(n, k, 2))
        for k in range(2)
    ]
    prompt, table = PROMPTS[2], [0, 1, 2, 3]
    tokens, a = list(prompt), None
    for start, stop in ((0, 24), (24, 40), *((k, k + 1) for k in range(40, 45))):
        if a is not None and start >= len(prompt):  # decodes: the greedy token of the last step
            tokens.append(int(a[-1].argmax()))
        steps = [StepSequence(tokens[start:stop], start, table, samples=stop >= len(prompt))]
        a, b = whole.execute(steps), _through(stages, steps)
        # (to float32 rounding: the whole runner's language model is the conditional model's, loaded otherwise)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert len(tokens) == 45
    # no stage holds (or would copy) a tensor of the vision model's; together they hold the language model's
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    held = [[k for k in names if holds(stage_of(n, i, 2), multimodal=True)(k)] for i in range(2)]
    text = {k for k in names if k.startswith(("language_model.", "model.language_model.", "lm_head."))}
    assert set(held[0]) | set(held[1]) == text and not set(held[0]) & set(held[1]), sorted(set(names) - text)
    assert len(text) < len(names)  # (the vision model's tensors: the rest)
    with pytest.raises(PylonError, match=r"stages serve its text: set engine.max_images_per_prompt to 0"):
        ModelRunner(str(directory), num_blocks=4, block_size=16, device="cpu", stage=stage_of(n, 1, 2), images=True)


def test_a_replica_of_stages_asks_for_a_bundle_a_stage():
    from pylon.serving.api.builder import pipeline_placement
    from pylon.specs import DeploymentSpec

    def spec(**engine):
        return DeploymentSpec(name="m", model="s3://b/m", engine=engine, replica={"num_cpus": 2, "num_gpus": 1})

    assert pipeline_placement(spec()) == {}
    assert pipeline_placement(spec(pipeline_parallel=3, pipeline_placement="strict_spread", device="cuda")) == {
        "placement_group_bundles": [{"CPU": 2, "GPU": 1}] * 3,
        "placement_group_strategy": "STRICT_SPREAD",
    }
    cpu = DeploymentSpec(name="m", model="s3://b/m", engine={"pipeline_parallel": 2}, replica={"num_cpus": 0.5})
    assert pipeline_placement(cpu) == {
        "placement_group_bundles": [{"CPU": 0.5}] * 2,
        "placement_group_strategy": "SPREAD",
    }
    # stages of tensor-parallel shards: a bundle a stage (on one node), as many replicas' resources as its shards
    staged = spec(pipeline_parallel=2, tensor_parallel=8, device="cuda")
    assert pipeline_placement(staged) == {
        "placement_group_bundles": [{"CPU": 16, "GPU": 8}] * 2,
        "placement_group_strategy": "SPREAD",
    }


_PEAK_RSS = """
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
from pylon.serving.model.stages import load_stage, stage_of

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

def peak_growth(load):
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) reset to the resident memory now
    before = status("VmRSS")
    model = load()
    for p in model.parameters():  # every weight read once (a checkpoint's tensors may be mapped, untouched)
        p.detach().sum()
    return status("VmHWM") - before, model

config = AutoConfig.from_pretrained(sys.argv[1])
with torch.device("meta"):  # the family's modules imported before anything is measured
    AutoModelForCausalLM.from_config(config)
stage_of_4 = stage_of(config.num_hidden_layers, 1, 4)
stage, kept = peak_growth(lambda: load_stage(sys.argv[1], config, torch.float32, stage_of_4))
whole, _ = peak_growth(lambda: AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32))
print(stage, whole)
"""


def test_loading_a_stage_never_reads_the_other_stages_weights(tmp_path):
    """The process's peak resident memory (not a count of tensors: what the OS gave it, mapped file pages included)
    while loading stage 2 of 4 of a ~52 MB model grows by less than half of what loading the whole model grows it
    by (the stage holds a quarter of the layers): the other stages' tensors are never read, not even for a moment."""
    import subprocess
    import sys

    directory = _saved(
        tmp_path / "llama",
        "llama",
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
    )
    size = sum(p.stat().st_size for p in (tmp_path / "llama").glob("*.safetensors"))
    done = subprocess.run([sys.executable, "-c", _PEAK_RSS, directory], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    stage, whole = map(int, done.stdout.split()[-2:])
    assert whole > 0.9 * size, (whole, size)
    assert stage < 0.5 * whole, (stage, whole, size)


def test_hidden_states_cross_between_stages_as_bytes_even_without_rows():
    """A step's hidden states between stages (`packed`, `unpacked`): bf16 and fp32 rows as they were; a step without
    rows to sample (a long prompt's chunk alone) hands back `[0, hidden]`, which once stopped the engine's step."""
    from pylon.serving.engine.split import packed, unpacked

    for tensor in (torch.randn(5, 8), torch.randn(3, 8).to(torch.bfloat16), torch.empty(0, 8)):
        got, seconds = unpacked(packed(tensor, 0.5))
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor) and seconds == 0.5


def test_microbatches_cut_a_step_into_contiguous_groups_of_about_as_many_tokens():
    from pylon.serving.engine.pipeline import microbatches

    def step(*tokens):
        return [StepSequence([1] * n, 0, [0], True) for n in tokens]

    def sizes(groups):
        return [[s.num_new_tokens for s in g] for g in groups]

    decodes = step(*[1] * 16)
    assert sizes(microbatches(decodes, 2)) == [[1] * 8, [1] * 8]
    assert sizes(microbatches(decodes, 3)) == [[1] * 6, [1] * 5, [1] * 5]
    assert sizes(microbatches(step(40, 1, 1, 1), 2)) == [[40], [1, 1, 1]]
    assert sizes(microbatches(step(1, 1, 1, 40), 2)) == [[1, 1, 1], [40]]
    assert sizes(microbatches(step(5, 5), 4)) == [[5], [5]]
    assert sizes(microbatches(step(64), 2)) == [[64]]  # one sequence: whole
    assert sizes(microbatches(decodes, 1)) == [[1] * 16]
    for count in (2, 3, 4):  # every sequence once, in order
        groups = microbatches(decodes, count)
        assert [s for g in groups for s in g] == decodes and all(groups)


def _tensors(directory) -> dict[str, torch.Tensor]:
    from pathlib import Path

    return {k: v for f in sorted(Path(directory).glob("*.safetensors")) for k, v in load_file(f).items()}


def _uploaded(directory: str, uri: str) -> None:
    from pathlib import Path

    from pylon import storage

    for path in Path(directory).iterdir():
        storage.upload_file(path, f"{uri}/{path.name}")


@pytest.mark.parametrize("max_shard_size", [None, "60KB"], ids=["one-file", "shards"])
def test_from_object_storage_a_stage_copies_only_its_own_tensors(tmp_path, s3_root, max_shard_size):
    """Stages of a checkpoint in S3 (one safetensors file; or shards with an index): each stage's copy holds its own
    tensors alone, byte for byte the checkpoint's, read by byte range (what it read: its tensors and the headers, a
    fraction of the checkpoint; a shard without any of them not read at all); together the stages copy every tensor
    once; each loads with none of its weights missing, and computes what the stage loaded from the whole checkpoint
    computes."""
    import json
    import os
    import struct

    from pylon.serving.model.stages import holds, load_stage, stage_model_dir

    local = _saved(
        tmp_path / "llama",
        "llama",
        max_shard_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
    )
    whole = _tensors(local)
    size = sum(os.path.getsize(f"{local}/{n}") for n in os.listdir(local) if n.endswith(".safetensors"))
    shards = sorted(n for n in os.listdir(local) if n.endswith(".safetensors"))
    assert (len(shards) > 3) == (max_shard_size is not None), shards
    _uploaded(local, s3_root)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(local)
    copied: list[str] = []
    for k in range(3):
        with stage_model_dir(s3_root, k, 3) as (directory, stage, read):
            assert stage == stage_of(6, k, 3)
            mine = _tensors(directory)
            expected = {n for n in whole if holds(stage)(n)}
            assert set(mine) == expected and expected, (k, sorted(mine))
            assert all(torch.equal(mine[n], whole[n]) for n in mine)
            tensor_bytes = sum(t.numel() * t.element_size() for t in mine.values())
            files = [n for n in os.listdir(directory) if n.endswith(".safetensors")]
            # read: its tensors, and the headers of the files it copied from
            headers = sum(8 + struct.unpack("<Q", open(f"{local}/{n}", "rb").read(8))[0] for n in files)
            assert read == tensor_bytes + headers, (read, tensor_bytes, headers)
            assert read < 0.6 * size, (read, size)
            if max_shard_size is not None:
                index = json.load(open(f"{directory}/model.safetensors.index.json"))
                assert set(index["weight_map"]) == expected
                assert set(files) == set(index["weight_map"].values()) < set(shards)  # the other shards: not there
            model = load_stage(directory, config, torch.float32, stage)
            reference = load_stage(local, config, torch.float32, stage)
            assert model.state_dict().keys() == reference.state_dict().keys()
            assert all(torch.equal(v, reference.state_dict()[n]) for n, v in model.state_dict().items())
            copied += mine
    assert sorted(copied) == sorted(whole)  # every tensor, by exactly one stage


def test_a_stage_copying_a_broken_checkpoint_says_which_file(tmp_path, s3_root):
    """An index naming a shard that is not there, a file that is not safetensors, a file shorter than its header
    says: each a PylonError naming the model and the file."""
    import json
    import os
    import struct

    from pylon import storage
    from pylon.serving.model.stages import stage_model_dir

    local = _saved(
        tmp_path / "llama",
        "llama",
        "60KB",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    index = json.load(open(f"{local}/model.safetensors.index.json"))
    last = sorted(set(index["weight_map"].values()))[-1]
    _uploaded(local, s3_root)
    storage.remove(f"{s3_root}/{last}")
    with pytest.raises(
        PylonError,
        match=rf"model.path {s3_root} .*: model.safetensors.index.json names files that are not there \({last}\)",
    ):
        with stage_model_dir(s3_root, 1, 2):
            pass
    storage.atomic_write(f"{s3_root}/{last}", b"not a safetensors file")
    with pytest.raises(PylonError, match=rf"model.path {s3_root} .*: {last}: not a safetensors file"):
        with stage_model_dir(s3_root, 1, 2):
            pass
    data = open(f"{local}/{last}", "rb").read()
    (length,) = struct.unpack("<Q", data[:8])
    storage.atomic_write(f"{s3_root}/{last}", data[: 8 + length + 10])  # the header whole, the data cut short
    with pytest.raises(PylonError, match=rf"model.path {s3_root} .*: {last}: truncated"):
        with stage_model_dir(s3_root, 1, 2):
            pass
    assert os.path.getsize(f"{local}/{last}") > 8 + length + 10


def test_stages_serve_lora_adapters_each_applying_its_own_layers_matrices(tmp_path):
    """engine.adapters with pipeline stages: each stage loads an adapter's matrices of its own layers only (none of
    another stage's, and an adapter of another stage's layers alone still loads there); a step mixing the base model
    and two adapters through the stages gives the whole model's logits with those adapters, exactly, and greedy
    decoding through them is peft's own for each adapter."""
    from engine_models import PROMPTS, hf_greedy
    from test_lora_engine import TARGETS, save_adapter

    family = Family("llama", tmp_path / "llama", greedy=False)
    n = family.model.config.num_hidden_layers
    attention, everything = TARGETS["llama"]
    dirs, peft = [], []
    for name, seed, config in (
        ("terse", 1, {"r": 4, "lora_alpha": 8, "target_modules": attention}),
        ("wordy", 2, {"r": 8, "lora_alpha": 16, "target_modules": everything, "use_rslora": True}),
        ("late", 3, {"r": 4, "lora_alpha": 8, "target_modules": attention, "layers_to_transform": [n - 1]}),
    ):
        dirs.append(str(tmp_path / name))
        peft.append(save_adapter(family.dir, dirs[-1], seed, **config))

    def runner(stage=None) -> ModelRunner:
        return ModelRunner(
            family.dir, num_blocks=32, block_size=16, dtype="fp32", device="cpu", stage=stage, adapters=dirs
        )

    whole = runner()
    stages = [runner(stage_of(n, k, 2)) for k in range(2)]
    for k, staged in enumerate(stages):
        for adapter in staged.adapter_set.adapters:
            layers = {int(m.split(".")[2]) for m in adapter.weights}
            assert layers <= set(staged.layers), (k, layers)
    assert not stages[0].adapter_set.adapters[2].weights  # "late" adapts the last layer only: stage 2's
    assert stages[1].adapter_set.adapters[2].weights

    # one step of three sequences (base, terse, wordy), each a prompt's first chunk, then decodes together
    prompts = [PROMPTS[0][:20], PROMPTS[1][:20], PROMPTS[2][:20], PROMPTS[3][:20]]
    tables = [[0, 1], [2, 3], [4, 5], [6, 7]]
    slots = [0, 1, 2, 3]
    steps = [StepSequence(p, 0, t, samples=True, adapter=a) for p, t, a in zip(prompts, tables, slots)]
    a, b = whole.execute(steps), _through(stages, steps)
    assert torch.equal(a, b), (a - b).abs().max()
    tokens = [list(p) for p in prompts]
    for _ in range(5):
        for seq, row in zip(tokens, a):
            seq.append(int(row.argmax()))
        steps = [
            StepSequence([s[-1]], len(s) - 1, t, samples=True, adapter=k) for s, t, k in zip(tokens, tables, slots)
        ]
        a, b = whole.execute(steps), _through(stages, steps)
        assert torch.equal(a, b), (a - b).abs().max()
    for seq, row in zip(tokens, a):
        seq.append(int(row.argmax()))
    references = [family.model, *peft]
    for seq, prompt, model in zip(tokens, prompts, references):
        assert seq[len(prompt) :] == hf_greedy(model, prompt, 6)

    # loaded on demand (engine.dynamic_adapters: read_adapter, put_adapter), each stage reading its own layers'
    for runner in (whole, *stages):
        runner.put_adapter(4, runner.read_adapter(dirs[1]))
    steps = [StepSequence(PROMPTS[4][:20], 0, [8, 9], samples=True, adapter=4)]
    a, b = whole.execute(steps), _through(stages, steps)
    assert torch.equal(a, b) and torch.equal(b, _through(stages, [dataclasses.replace(steps[0], adapter=2)]))
