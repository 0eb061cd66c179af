"""engine.quantization int8 end to end: the engine with int8 projections computes what `transformers` computes with
the dequantized weights (so its only error is int8's rounding), that rounding keeps a realistically scaled GPT-2's
logits close to the float engine's, and fp8 is refused at start on a CPU (on a GPU of compute capability 8.9+, fp8
computes the same way: `make test-gpu`)."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_models import FAMILIES, GREEDY, NEW_TOKENS, ON_CUDA, PROMPTS, run, spec, tokens_of
from transformers import AutoConfig, AutoModelForCausalLM

from pylon.data.tokenizer import ByteTokenizer
from pylon.errors import PylonError
from pylon.serving.engine.engine import LLMEngine
from pylon.serving.model.quant import QuantLinear, QuantWeight
from pylon.serving.model.step import StepSequence


def _greedy(engine) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    outputs = run(engine)
    return [tokens_of(outputs[str(i)]) for i in range(len(PROMPTS))]


def _last_logits(engine, prompt: list[int]) -> torch.Tensor:
    n = -(-len(prompt) // engine.spec.block_size)  # outside any request: nothing else runs
    blocks = list(range(n))
    groups = tuple(list(range(g * n, (g + 1) * n)) for g in range(len(engine.runner.kv_groups)))  # (a table a group)
    step = StepSequence(token_ids=prompt, start=0, block_table=groups[0] if groups else blocks, samples=True)
    return engine.runner.execute([dataclasses.replace(step, group_tables=groups)])[0]


def _dequantized_copy(model, method: str = "int8"):
    """`model` with each decoder-layer projection's weight replaced by its int8 (or fp8, int4) round trip."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(getattr(module, "gate_up_proj", None), torch.Tensor):  # an MoE layer's 3-D experts
                # GPT-OSS's and Llama 4's: [experts, in, out]
                transposed = hasattr(module, "gate_up_proj_bias") or type(module).__name__ == "Llama4TextExperts"
                for w in (module.gate_up_proj, module.down_proj):
                    for e in range(len(w)):
                        we = w[e].t() if transposed else w[e]  # quantized per output channel, as the engine does
                        we.copy_(QuantWeight(we.float(), method).dequantized(torch.float32))
                continue
            if name.endswith("shared_expert_gate"):  # Qwen2-MoE's: one output, kept in float as the router is
                continue
            if name.endswith(("project_in", "project_out")):  # OPT-350m's, outside its layers: float as the lm_head
                continue
            if module is model.get_output_embeddings() or type(module).__name__ not in ("Linear", "Conv1D"):
                continue
            gpt2 = type(module).__name__ == "Conv1D"  # weight [in, out]
            w = module.weight.t() if gpt2 else module.weight
            back = QuantWeight(w.float(), method).dequantized(torch.float32)
            module.weight.copy_(back.t() if gpt2 else back)
    return model


def _reference_greedy(reference, device) -> list[list[int]]:
    """transformers' greedy tokens for each of PROMPTS."""
    greedy = []
    for p in PROMPTS:
        ids = torch.tensor([p], device=device)
        out = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=256,
            pad_token_id=257,
        )  # fmt: skip
        greedy.append(out[0, len(p) :].tolist())
    return greedy


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_int8_engine_computes_the_dequantized_model(family) -> None:
    engine = family.engine(quantization="int8")
    runner = engine.runner
    if family.name == "gpt2":
        assert all(isinstance(layer.qkv_w, QuantWeight) for layer in runner._gpt2.layers)
        assert runner.model.transformer.h[0].mlp.c_fc.weight is None  # no float copy kept
    else:
        assert isinstance(runner.model.model.layers[0].self_attn.q_proj, QuantLinear)
        assert isinstance(runner.model.model.layers[0].mlp.down_proj, QuantLinear)
    assert not runner.packed_linear and runner.model.lm_head.weight.dtype == torch.float32  # lm_head stays float

    reference = _dequantized_copy(family.model)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPTS[3]], device=family.model.device)).logits[0, -1]
    assert _rel(_last_logits(engine, PROMPTS[3]), want) < 1e-4
    # Greedy: token for token transformers' generate over the dequantized weights, however the engine batches.
    ref_greedy = _reference_greedy(reference, family.model.device)
    assert _greedy(engine) == ref_greedy
    assert ref_greedy != family.greedy  # this model's (initializer 0.5) outputs do move with int8's rounding


def test_int4_engine_computes_the_dequantized_model(family) -> None:
    """engine.quantization int4: every decoder projection 4-bit in groups (the kernel where the inputs are whole
    blocks of 32; Llama's 344-wide down projection padded and dequantized per call), the engine's logits and greedy
    tokens those of transformers over the dequantized weights."""
    engine = family.engine(quantization="int4")
    runner = engine.runner
    if family.name == "gpt2":
        assert all(isinstance(layer.qkv_w, QuantWeight) and layer.qkv_w.int4_kernel for layer in runner._gpt2.layers)
    else:
        layer = runner.model.model.layers[0]
        assert layer.self_attn.q_proj.weight_q.int4_kernel and layer.self_attn.q_proj.weight_q.group == 64
        assert layer.mlp.down_proj.weight_q.group is None and not layer.mlp.down_proj.weight_q.int4_kernel
    reference = _dequantized_copy(family.model, "int4")
    with torch.no_grad():
        want = reference(torch.tensor([PROMPTS[3]], device=family.model.device)).logits[0, -1]
    assert _rel(_last_logits(engine, PROMPTS[3]), want) < 1e-4
    assert _greedy(engine) == _reference_greedy(reference, family.model.device)


def test_int8_keeps_a_gpt2_at_its_trained_scale_close_to_float(tmp_path: Path) -> None:
    """At GPT-2's own initializer (0.02) int8's rounding moves the logits by well under 2%."""
    tok = ByteTokenizer()
    config = AutoConfig.for_model("gpt2", **FAMILIES["gpt2"], eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    (tmp_path / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))
    engines = {q: LLMEngine(str(tmp_path), spec(quantization=q)) for q in ("none", "int8")}
    for prompt in PROMPTS[:4]:
        float_logits, int8_logits = (_last_logits(engines[q], prompt) for q in ("none", "int8"))
        assert _rel(int8_logits, float_logits) < 0.02
        assert (int8_logits.log_softmax(-1) - float_logits.log_softmax(-1)).abs().max() < 0.05


@pytest.mark.skipif(ON_CUDA, reason="on a GPU of compute capability 8.9+ fp8 is served")
def test_fp8_is_refused_at_engine_start_on_a_cpu(gpt2) -> None:
    with pytest.raises(PylonError, match=r"engine\.quantization: fp8 .* use int8"):
        gpt2.engine(quantization="fp8")


@pytest.mark.skipif(
    not (ON_CUDA and torch.cuda.get_device_capability() >= (8, 9)),
    reason="fp8 weights need a CUDA GPU of compute capability 8.9+ (make test-gpu)",
)
def test_fp8_engine_computes_the_dequantized_model(family) -> None:
    """On a GPU that has fp8 (Ada, Hopper): float8 e4m3 projections, one scale per output channel, compute what
    transformers computes over the weights' fp8 round trip, and keep the model's greedy tokens on most prompts."""
    engine = family.engine(quantization="fp8")
    quantized = [m.weight_q for m in engine.runner.model.modules() if isinstance(m, QuantLinear)]
    gpt2 = getattr(engine.runner, "_gpt2", None)
    quantized += [layer.qkv_w for layer in gpt2.layers] if gpt2 is not None else []
    assert quantized and all(w.q.dtype == torch.float8_e4m3fn for w in quantized)
    reference = _dequantized_copy(family.model, "fp8")
    with torch.no_grad():
        want = reference(torch.tensor([PROMPTS[3]], device=family.model.device)).logits[0, -1]
    assert _rel(_last_logits(engine, PROMPTS[3]), want) < 1e-3


def _trained_scale_gpt2(directory: Path) -> None:
    """A GPT-2 at its trained scale (initializer 0.02), saved as a Pylon export."""
    tok = ByteTokenizer()
    config = AutoConfig.for_model(
        "gpt2", vocab_size=tok.vocab_size, n_positions=256, n_embd=128, n_layer=2, n_head=4, eos_token_id=tok.eos_id
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    (directory / "pylon_tokenizer.json").write_text(json.dumps(tok.info.model_dump(mode="json")))


def _scaled_mm_here(monkeypatch) -> None:
    """On a CPU, where torch has `_scaled_mm` too, switch the fp8 matmul on for a test (the engine refuses fp8
    there)."""
    from pylon.serving.model import quant

    if not ON_CUDA:
        monkeypatch.setattr(quant, "SCALED_MM_DEVICES", ("cuda", "cpu"))
        monkeypatch.setattr(quant, "check", lambda method, device: None)


def test_an_fp8_bf16_projection_multiplies_the_fp8_operands_with_both_scales(monkeypatch) -> None:
    """A bf16 fp8 projection is `torch._scaled_mm` over the weight's e4m3 values and the input's, each token's row
    quantized with its own scale (W8A8, as vLLM's fp8): what those operands give multiplied in float32, and not the
    weight-only result."""
    from pylon.serving.model import quant

    _scaled_mm_here(monkeypatch)
    device = torch.device("cuda" if ON_CUDA else "cpu")
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 256, generator=g) * 0.02, torch.randn(96, generator=g) * 0.1
    q = quant.QuantWeight(w.to(device, torch.bfloat16), "fp8")
    assert q.scaled_mm and q.q.dtype == torch.float8_e4m3fn
    for rows in (1, 7, 64):
        x = (torch.randn(rows, 256, generator=g) * torch.logspace(-2, 1, 256)).to(device, torch.bfloat16)
        got = quant.addmm(b.to(device, torch.bfloat16), x, q).float()
        xq, sx = quant.quantize_rows(x)
        want = (xq.float() * sx) @ (q.q.float() * q.scales_row.view(-1, 1)).t() + b.to(device).bfloat16().float()
        weight_only = F.linear(x.float(), q.dequantized(torch.float32), b.to(device).bfloat16().float())
        assert _rel(got, want) < 5e-3, rows
        assert _rel(got, weight_only) > 3 * _rel(got, want), rows  # the input's rounding is there


def test_an_fp8_bf16_engine_runs_every_projection_on_fp8_and_stays_close_to_bf16(tmp_path: Path, monkeypatch) -> None:
    """The engine's fp8 bf16 projections all take the fp8 matmul, and a GPT-2 at its trained scale keeps its bf16
    logits within fp8's rounding and its most likely next token."""
    from pylon.serving.model import quant

    _scaled_mm_here(monkeypatch)
    calls = []
    real = quant.fp8_matmul
    monkeypatch.setattr(quant, "fp8_matmul", lambda *a: calls.append(a[0].shape) or real(*a))  # counts, then runs it
    _trained_scale_gpt2(tmp_path)
    engines = {q: LLMEngine(str(tmp_path), spec(quantization=q, dtype="bf16")) for q in ("none", "fp8")}
    layers = engines["fp8"].runner._gpt2.layers
    assert all(w.scaled_mm for layer in layers for w in (layer.qkv_w, layer.proj_w, layer.fc_w, layer.down_w))
    for prompt in PROMPTS[:4]:
        calls.clear()
        fp8, bf16 = (_last_logits(engines[q], prompt).float() for q in ("fp8", "none"))
        assert len(calls) == 4 * len(layers)  # qkv, attention output, MLP up and down, each layer
        # e4m3 keeps 3 mantissa bits: the weights' rounding alone moves these logits 3-5% (int8's: ~1%), the inputs'
        # adds 1-2% (measured on this model); the most likely next token stays
        assert _rel(fp8, bf16) < 0.1
        assert fp8.argmax() == bf16.argmax()
