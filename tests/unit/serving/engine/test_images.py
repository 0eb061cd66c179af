"""Images in chat prompts (pylon.serving.engine.images) through the engine, against the conditional model as
`transformers` computes it on its processor's inputs: each generated token's log-probability within 1e-4 of the
reference's (teacher-forced), through batching, prompt chunks cut around an image's tokens, the prefix cache (one
image's blocks never serve another's), and preemption; Gemma 3's images attended both ways. The fixtures make each
check able to fail: two images, Gemma 3's images attended causally, or Qwen's rotated by their positions alone, move
the log-probabilities by more than ten times the tolerance (asserted below), so a wrong image, a cache hit across
images, a causal mask or flat positions are caught."""

from __future__ import annotations

import shutil

import image_models
import pytest
import torch
from engine_models import DEVICE, run, spec, tokens_of

from pylon.serving.engine.engine import LLMEngine
from pylon.serving.engine.images import ImagePrompt
from pylon.serving.engine.sampling import SamplingParams
from pylon.serving.errors import InvalidRequest

NEW = 8
PARAMS = SamplingParams(max_tokens=NEW, temperature=0, logprobs=2)
TOL = 1e-4
# Qwen3.5's recurrent layers: a prompt computed in other chunks than the reference's rounds its chunked delta rule
# otherwise (fp32, 1e-4's order: tests/unit/serving/engine/test_recurrent_prefix_cache.py), more with MoE routing
RECURRENT_TOL = 1e-3
RECURRENT = ("qwen3_5", "qwen3_5_moe")


def _tol(name: str) -> float:
    return RECURRENT_TOL if name in RECURRENT else TOL


def _user(*parts) -> list[dict]:
    content = [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module", params=["gemma3", "mistral3", *image_models.QWEN_VL, "internvl", "llava"])
def checkpoint(request, tmp_path_factory):
    directory = image_models.image_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, directory, image_models.Reference(directory)


def _prompts(directory):
    a, b, c = image_models.png(1), image_models.png(2, (40, 70)), image_models.png(3, (90, 30))
    one = image_models.render(directory, _user("describe ", None, " what you see in it"))
    two = image_models.render(directory, _user("compare ", None, " and ", None, " please"))
    text = image_models.render(directory, [{"role": "user", "content": "what is in the picture"}])
    return {
        "a": (one, (a,)),
        "b": (one, (b,)),
        "ac": (two, (a, c)),
        "ca": (two, (c, a)),
        "text": (text, ()),
    }


def _check(reference, prompt, out) -> None:
    """`out`'s tokens are the reference's greedy ones, and each one's log-probability (and its alternatives') the
    reference's, teacher-forced."""
    text, images = prompt
    tokens = tokens_of(out)
    tol = _tol(reference.model.config.model_type)
    assert tokens == reference.greedy(text, list(images), NEW)
    want = reference.logprobs(text, list(images), tokens)
    got = [lp for o in out for lp in o.logprobs]
    for i, lp in enumerate(got):
        assert abs(lp.logprob - float(want[i, lp.token_id])) < tol, (i, lp, float(want[i, lp.token_id]))
        for token, logprob in lp.top:
            assert abs(logprob - float(want[i, token])) < tol


def _engine_prompt(prompt):
    text, images = prompt
    return ImagePrompt(text, images) if images else text


def test_the_fixture_tells_images_apart(checkpoint) -> None:
    """Two images, and (Gemma 3) images attended causally rather than both ways, move the reference's
    log-probabilities by more than ten times the engine's tolerance (1e-3 where it is 1e-4): the engine's agreeing within
    it means it read each image, in its mask."""
    name, directory, reference = checkpoint
    apart = 10 * _tol(name)
    prompts = _prompts(directory)
    text, (a,) = prompts["a"]
    tokens = reference.greedy(text, [a], NEW)
    with_a = reference.logprobs(text, [a], tokens)
    assert (with_a - reference.logprobs(text, [prompts["b"][1][0]], tokens)).abs().max() > apart
    assert (
        reference.logprobs(*prompts["ac"][0:1], list(prompts["ac"][1]), tokens)
        - reference.logprobs(prompts["ca"][0], list(prompts["ca"][1]), tokens)
    ).abs().max() > apart  # the order of the images matters too
    if name == "gemma3":
        assert (with_a - reference.logprobs(text, [a], tokens, causal=True)).abs().max() > apart
    if name in image_models.QWEN_VL:  # M-RoPE: the images' tokens rotated by their place in the image
        assert (with_a - reference.logprobs(text, [a], tokens, flat=True)).abs().max() > apart


@pytest.mark.parametrize("fields", [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 2}], ids=["whole", "chunked"])
def test_images_are_read_as_transformers_reads_them(checkpoint, fields) -> None:
    """Prompts with one image, two (in both orders) and none, in one batch, then again (their blocks now cached):
    each the reference's tokens and log-probabilities. Chunked: 8 tokens a step, so prompts are cut in chunks, never
    inside an image's tokens; the second pass starts past the cached blocks, images included."""
    _, directory, reference = checkpoint
    prompts = _prompts(directory)
    engine = LLMEngine(str(directory), spec(block_size=4, **fields))
    assert engine.runner.vision is not None and engine.images is not None
    for round in range(2):
        for key, prompt in prompts.items():
            engine.add_request(f"{round}-{key}", _engine_prompt(prompt), PARAMS)
        outputs = run(engine)
        for key, prompt in prompts.items():
            _check(reference, prompt, outputs[f"{round}-{key}"])
        if round:  # every prompt found its blocks, images and all: the last token's block is computed again
            assert all(
                outputs[f"1-{k}"][-1].num_cached_tokens >= outputs[f"1-{k}"][-1].num_prompt_tokens - 4 for k in prompts
            )
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_one_images_cached_blocks_never_serve_another(checkpoint) -> None:
    """The same text with another image shares only the blocks before the image; the same image, every block."""
    _, directory, reference = checkpoint
    prompts = _prompts(directory)
    engine = LLMEngine(str(directory), spec(block_size=4))
    engine.add_request("a", _engine_prompt(prompts["a"]), PARAMS)
    first = run(engine)["a"]
    ids, inputs = engine.images.prepare(ImagePrompt(*prompts["a"]))
    for key in ("b", "a"):
        engine.add_request(key, _engine_prompt(prompts[key]), PARAMS)
        out = run(engine)[key]
        _check(reference, prompts[key], out)
        cached = out[-1].num_cached_tokens
        if key == "b":  # the text before the image only (Qwen3.5's recurrent layers: where a state was kept)
            assert (0 if engine.runner.recurrent else 1) <= cached <= inputs.positions[0]
        else:
            assert cached >= len(ids) - 4 and tokens_of(out) == tokens_of(first)
    stats = engine.stats()  # the cached image was not run through the vision tower again
    assert (stats.images_total, stats.images_encoded_total) == (3, 2)


def test_a_preempted_request_reads_its_images_again(checkpoint) -> None:
    """A KV cache too small for every request at once: some are preempted and recomputed, their images run through
    the vision tower again, with the same results."""
    _, directory, reference = checkpoint
    prompts = _prompts(directory)
    engine = LLMEngine(
        str(directory),
        spec(
            block_size=4, kv_cache_tokens=128, max_model_len=128, max_num_batched_tokens=16, enable_prefix_caching=False
        ),
    )
    keys = ["a", "b", "ac", "ca"]
    for key in keys:
        engine.add_request(key, _engine_prompt(prompts[key]), SamplingParams(max_tokens=24, temperature=0, logprobs=0))
    outputs = run(engine)
    assert engine.stats().num_preemptions_total > 0
    for key in keys:
        text, images = prompts[key]
        tokens = tokens_of(outputs[key])
        assert tokens == reference.greedy(text, list(images), 24)


def test_images_are_refused_where_they_cannot_be_read(checkpoint, tmp_path, caplog) -> None:
    name, directory, _ = checkpoint
    prompts = _prompts(directory)
    prompt = ImagePrompt(*prompts["ac"])
    engine = LLMEngine(str(directory), spec(max_images_per_prompt=1, max_num_batched_tokens=3))
    with pytest.raises(InvalidRequest, match=r"2 images; this deployment takes at most 1 \(engine.max_images_per"):
        engine.add_request("two", prompt, PARAMS)
    if name == "gemma3":  # its images attend both ways, in one step each (Mistral's are cut in chunks as text is)
        with pytest.raises(InvalidRequest, match=r"4 tokens.*engine.max_num_batched_tokens \(3\)"):
            engine.add_request("long", ImagePrompt(*prompts["a"]), PARAMS)
    else:
        engine.add_request("long", ImagePrompt(*prompts["a"]), PARAMS)
        assert tokens_of(run(engine)["long"])
    with pytest.raises(InvalidRequest, match="image placeholders|do not fit the prompt"):
        engine.add_request("marker", ImagePrompt(prompts["text"][0], prompts["a"][1]), PARAMS)
    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        engine.add_request("scored", ImagePrompt(*prompts["a"]), SamplingParams(max_tokens=1, prompt_logprobs=1))
    # Text only: by the spec (the vision tower dropped at load), or a checkpoint saved without its processor.
    text_only = LLMEngine(str(directory), spec(max_images_per_prompt=0))
    assert text_only.runner.vision is None and text_only.images is None
    with pytest.raises(InvalidRequest, match=r"text only \(engine.max_images_per_prompt: 0\)"):
        text_only.add_request("x", ImagePrompt(*prompts["a"]), PARAMS)
    bare = tmp_path / "bare"
    shutil.copytree(directory, bare)
    for name in ("processor_config.json", "preprocessor_config.json"):
        (bare / name).unlink(missing_ok=True)
    engine = LLMEngine(str(bare), spec())
    assert engine.images is None and "without its image processor" in caplog.text
    with pytest.raises(InvalidRequest, match="text only"):
        engine.add_request("x", ImagePrompt(*prompts["a"]), PARAMS)
    assert DEVICE in ("cpu", "cuda")


def test_an_image_that_cannot_be_decoded_is_refused(checkpoint) -> None:
    """A file whose header reads (so the replica's check passes) but whose pixels are cut off: a 400, not a failure
    of the engine, which serves on."""
    _, directory, _ = checkpoint
    prompts = _prompts(directory)
    text, (a,) = prompts["a"]
    engine = LLMEngine(str(directory), spec())
    with pytest.raises(InvalidRequest, match="image 1 of the request cannot be decoded"):
        engine.add_request("cut", ImagePrompt(text, (a[: len(a) // 2],)), PARAMS)
    engine.add_request("whole", ImagePrompt(text, (a,)), PARAMS)
    assert tokens_of(run(engine)["whole"])


@pytest.mark.parametrize(
    "fields",
    [
        {"speculative": {"method": "ngram", "num_tokens": 3}},
        {"speculative": {"method": "ngram", "num_tokens": 4, "tree_width": 2}},
        {"kv_cache_dtype": "bf16"},
        {"quantization": "int8"},
    ],
    ids=["ngram", "ngram-tree", "bf16-cache", "int8"],
)
def test_images_with_speculation_a_narrower_cache_and_int8_weights(checkpoint, fields) -> None:
    """Images beside the engine's other features: n-gram speculation, one path or a draft tree, gives the plain
    engine's greedy tokens (drafts verified as for text, Qwen's at their position + the M-RoPE offset); a bf16 KV cache (every chunk reading its keys back, Gemma 3's both ways) and int8 weights
    (the language model's projections; the vision tower stays float) serve them, the images still read (their
    outputs' log-probabilities differ with another image)."""
    name, directory, _ = checkpoint
    if "tree_width" in fields.get("speculative", {}) and name in RECURRENT:
        pytest.skip("draft trees are refused for a model with recurrent layers (test_speculative_tree.py)")
    prompts = _prompts(directory)
    # Every printable character in the prompt: a random model's tokens then recur in it, and prompt lookup drafts.
    alphabet = bytes(range(33, 127)).decode()
    text = image_models.render(directory, _user(alphabet, None, " what you see"))
    prompts |= {"a": (text, prompts["a"][1]), "b": (text, prompts["b"][1])}
    keys = ["a", "b", "ac"]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=2, ignore_eos=True)
    plain = LLMEngine(str(directory), spec(block_size=4, max_num_batched_tokens=8))
    for key in keys:
        plain.add_request(key, _engine_prompt(prompts[key]), params)
    want = run(plain)
    engine = LLMEngine(str(directory), spec(block_size=4, max_num_batched_tokens=8, **fields))
    if "speculative" in fields:
        from engine_models import speculating

        speculating(engine)
    for key in keys:
        engine.add_request(key, _engine_prompt(prompts[key]), params)
    got = run(engine)
    if "speculative" in fields:
        assert [tokens_of(got[k]) for k in keys] == [tokens_of(want[k]) for k in keys]
        assert engine.stats().spec_verify_steps_total > 0
    else:
        first = [lp.logprob for lp in got["a"][0].logprobs][:1] + [lp.logprob for lp in got["b"][0].logprobs][:1]
        assert abs(first[0] - first[1]) > 1e-4 or tokens_of(got["a"]) != tokens_of(got["b"])
        assert all(len(tokens_of(got[k])) == 16 for k in keys)


def test_the_planner_counts_what_the_engine_holds(checkpoint) -> None:
    """`pylon plan` sizes a deployment's weights as the engine holds them: the language model (Qwen-VL's built on
    its family's causal LM, which transformers lacks for it) and the vision tower with its projector (Qwen's `visual`,
    its merger inside), or the language model alone with engine.max_images_per_prompt: 0."""
    from pylon.plan.serve import plan_serve
    from pylon.specs import DeploymentSpec

    _, directory, reference = checkpoint
    inner = reference.model.model
    language = sum(p.numel() for p in inner.language_model.parameters()) + reference.model.lm_head.weight.numel()
    parts = (inner.visual,) if hasattr(inner, "visual") else (inner.vision_tower, inner.multi_modal_projector)
    seeing = sum(p.numel() for part in parts for p in part.parameters())
    plan = plan_serve(DeploymentSpec(name="m", model=str(directory)), gpu="A100-80GB")
    assert plan.rows[0].weights == (language + seeing) * 2  # bf16 on a GPU
    text_only = DeploymentSpec(name="m", model=str(directory), engine={"max_images_per_prompt": 0})
    assert plan_serve(text_only, gpu="A100-80GB").rows[0].weights == language * 2


def test_the_image_processor_takes_the_deployments_arguments(checkpoint) -> None:
    """engine.mm_processor_kwargs (vLLM's): Qwen-VL's min_pixels resizes each image to at least that many pixels (more
    tokens: the fixture's processor allows 4 to 16 an image), InternVL's max_patches cuts it into fewer tiles (one
    here, of up to 4), and the replies are the model's on images so processed; arguments the processor refuses fail
    the engine's start naming the field."""
    from pylon.errors import PylonError

    name, directory, _ = checkpoint
    if name not in (*image_models.QWEN_VL, "internvl"):
        pytest.skip("Qwen-VL's min_pixels, InternVL's max_patches (Gemma 3's images are a fixed size)")
    unit = 32 if name in ("qwen3_vl", "qwen3_5", "qwen3_5_moe") else 28  # a token's square of pixels
    kwargs = {"max_patches": 1} if name == "internvl" else {"min_pixels": 12 * unit * unit}
    prompts = _prompts(directory)
    engine = LLMEngine(str(directory), spec(block_size=4, mm_processor_kwargs=kwargs))
    plain = LLMEngine(str(directory), spec(block_size=4))
    for key in ("ac", "b"):
        _, changed = engine.images.prepare(ImagePrompt(*prompts[key]))
        _, inputs = plain.images.prepare(ImagePrompt(*prompts[key]))
        if name == "internvl":  # one tile an image, 4 tokens
            assert len(changed.positions) == 4 * len(prompts[key][1]) < len(inputs.positions)
        else:
            assert len(changed.positions) >= 12 * len(prompts[key][1]) > len(inputs.positions)
        engine.add_request(key, _engine_prompt(prompts[key]), PARAMS)
    outputs = run(engine)
    reference = image_models.Reference(directory, image_kwargs=kwargs)
    for key in ("ac", "b"):
        _check(reference, prompts[key], outputs[key])
    with pytest.raises(PylonError, match=r"engine.mm_processor_kwargs \['bogus'\]: .*refuses them"):
        LLMEngine(str(directory), spec(mm_processor_kwargs={"bogus": 1}))


def test_a_lora_adapter_of_the_conditional_model_adapts_its_language_model_reading_images(checkpoint, tmp_path) -> None:
    """A LoRA adapter trained on the conditional model (peft's names: `model.language_model.layers...`) adapts the
    engine's language model (for Qwen-VL, the family's causal LM it is built in) on a request with an image: its
    greedy tokens are the adapted conditional model's, beside a request of the base model in the same steps."""
    from peft import LoraConfig, get_peft_model

    _, directory, _ = checkpoint
    prompts = _prompts(directory)
    text, images = prompts["a"]
    reference = image_models.Reference(directory)
    base = reference.greedy(text, list(images), NEW)
    torch.manual_seed(3)
    targets = r".*language_model.*\.(q_proj|v_proj|o_proj)"  # (what the engine adapts in every family)
    reference.model = get_peft_model(
        reference.model, LoraConfig(init_lora_weights=False, r=8, lora_alpha=16, target_modules=targets)
    )
    with torch.no_grad():
        for key, p in reference.model.named_parameters():
            if "lora_B" in key:
                p.mul_(20)
    reference.model.save_pretrained(tmp_path / "adapter")
    adapted = reference.greedy(text, list(images), NEW)
    assert adapted != base
    engine = LLMEngine(str(directory), spec(block_size=4, adapters=[{"name": "t", "path": str(tmp_path / "adapter")}]))
    engine.add_request("adapted", ImagePrompt(text, images), SamplingParams(max_tokens=NEW, temperature=0, adapter="t"))
    engine.add_request("base", ImagePrompt(text, images), SamplingParams(max_tokens=NEW, temperature=0))
    outputs = run(engine)
    assert (tokens_of(outputs["adapted"]), tokens_of(outputs["base"])) == (adapted, base)


def test_decodes_after_images_replay_the_fixed_shape_steps(checkpoint) -> None:
    """Decode steps past a prompt's images run in the fixed shapes that CUDA graphs replay on a GPU (on a CPU, the same
    step eagerly: DecodeGraphs(capture=False)), Qwen-VL's rotated by position + its M-RoPE offset, one position a row:
    the reference's tokens, with most steps replayed."""
    from pylon.serving.model.graphs import DecodeGraphs

    name, directory, reference = checkpoint
    prompts = _prompts(directory)
    engine = LLMEngine(str(directory), spec(block_size=4, max_num_seqs=4))
    runner = engine.runner
    if runner.recurrent:
        pytest.skip("a model with recurrent layers decodes eagerly (its states per sequence)")
    runner.add_scratch_block()
    runner.decode_graphs = DecodeGraphs(runner, 4, engine.max_model_len, capture=False)
    runner.decode_graphs.capture_all()
    params = SamplingParams(max_tokens=16, temperature=0)
    keys = ["a", "ac", "ca", "text"]
    for key in keys:
        engine.add_request(key, _engine_prompt(prompts[key]), params)
    outputs = run(engine)
    for key in keys:
        text, images = prompts[key]
        assert tokens_of(outputs[key]) == reference.greedy(text, list(images), 16), key
    assert runner.decode_graphs.replays >= 12
