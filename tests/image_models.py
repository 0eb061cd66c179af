"""Tiny multimodal checkpoints as they ship, for the image tests (tests/unit/serving/engine/test_images.py, the HTTP
ones): a conditional model (vision tower, projector, language model) of Gemma 3 or Mistral 3 with random weights large
enough that each image changes the continuation, and beside it what a real checkpoint has for images: a Hugging Face
tokenizer with the family's image tokens and chat template, and the processor's files (processor_config.json,
preprocessor_config.json), so that `AutoProcessor.from_pretrained` loads them. Built offline, in seconds."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

VOCAB = 320  # the language model's embedding rows (the tokenizer's ids fit under it)
IMAGE = 56  # pixels a side the processors resize to: 4 x 4 patches of 14
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<start_of_image>{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_turn>\n{% endfor %}<start_of_turn>model\n"
)
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"]
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST]"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' or p.type == 'image_url' %}[IMG]{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"
)
PIXTRAL = {
    "processor_class": "PixtralProcessor",
    "patch_size": 14,
    "spatial_merge_size": 1,
    "image_token": "[IMG]",
    "image_break_token": "[IMG_BREAK]",
    "image_end_token": "[IMG_END]",
}
QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' or p.type == 'image_url' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p.type == 'text' %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)
# The Qwen vision-language families (their language model rotates each image's tokens by their place in the image,
# M-RoPE): Qwen2-VL, Qwen2.5-VL (its vision tower's windowed attention), Qwen3-VL (interleaved M-RoPE, and features of
# the vision tower's inner layers added to the language model's first layers: deepstack), Qwen3.5 (recurrent layers
# beside attention ones, a quarter of each head rotated; Qwen3.5-MoE's with mixture-of-experts MLPs).
QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
LLAVA_SPECIALS = ["<unk>", "<s>", "</s>", "<image>"]
LLAVA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m.role | upper }}: "
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' or p.type == 'image_url' %}<image>\n{% elif p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %} {% endfor %}ASSISTANT:"
)
INTERNVL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
INTERNVL_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", "<IMG_CONTEXT>\n")
TEXT = "the image shows a red square beside a green circle; describe what you see in the picture " * 4


def _tokenizer(specials: list[str], template: str, **tokens):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **tokens)


def _randomize(module: torch.nn.Module, scale: float) -> None:
    """Every weight of `module` random (the initializers leave Gemma 3's projector at zeros and norms at ones, which
    would make every image look alike)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * scale)


def _randomize_vision(model: torch.nn.Module, vision: tuple) -> None:
    """The vision parts' weights random (`_randomize`), and the language model's norms off their zeros and ones, as
    the family fixtures' are."""
    for part in vision:
        _randomize(part, 0.5)
    with torch.no_grad():
        for key, p in model.model.language_model.named_parameters():
            if "norm" in key:
                p.add_(torch.randn_like(p) * 0.25)


def image_checkpoint(
    name: str,
    directory: Path,
    *,
    text: dict | None = None,
    vision: dict | None = None,
    image: int = IMAGE,
    image_tokens: int = 4,
    max_image_tokens: int = 16,
) -> Path:
    """A tiny `name` ("gemma3", "mistral3", "internvl", "llava" or one of QWEN_VL) checkpoint saved in `directory`, with its tokenizer and processor.
    `text`, `vision`: shapes over the tests' (bench/serve_features.py's images section builds a larger one); `image`:
    the pixels a side images are resized to; `image_tokens`: Gemma 3's tokens an image (a square number);
    `max_image_tokens`: Qwen's most tokens an image (its processor's max_pixels)."""
    text_shape, vision_shape = text or {}, vision or {}
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3Processor,
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        PixtralImageProcessorPil,
    )

    torch.manual_seed(0)
    text = {
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "vocab_size": VOCAB,
        "initializer_range": 0.5,
    }
    if name in QWEN_VL:
        return _qwen_checkpoint(name, directory, text | text_shape, vision_shape, max_image_tokens)
    if name == "internvl":
        return _internvl_checkpoint(directory, text | text_shape, vision_shape)
    if name == "llava":
        return _llava_checkpoint(directory, text | text_shape, vision_shape)
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": image, "patch_size": 14, **vision_shape}
    if name == "gemma3":
        tok = _tokenizer(
            GEMMA_SPECIALS,
            GEMMA_TEMPLATE,
            bos_token="<bos>",
            eos_token="<eos>",
            pad_token="<pad>",
            extra_special_tokens={
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
        )
        ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("eos_token_id", "<eos>"), ("pad_token_id", "<pad>"))}
        # Gemma 3's layers: windowed (a window narrower than the prompts) and full, as the 1B checkpoint's config
        # lays them out (every 6th full), with two of them here.
        text |= {"num_hidden_layers": 3, "sliding_window": 16, "query_pre_attn_scalar": 20, **ids}
        text |= {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
        text |= {"rope_local_base_freq": 100.0, "final_logit_softcapping": None, "tie_word_embeddings": False}
        config = Gemma3Config(
            text_config=text | text_shape,
            vision_config=vision,
            mm_tokens_per_image=image_tokens,
            boi_token_index=tok.convert_tokens_to_ids("<start_of_image>"),
            eoi_token_index=tok.convert_tokens_to_ids("<end_of_image>"),
            image_token_index=tok.convert_tokens_to_ids("<image_soft_token>"),
            tie_word_embeddings=False,
            **ids,
        )
        model = Gemma3ForConditionalGeneration(config)
        processor = Gemma3Processor(
            image_processor=Gemma3ImageProcessorPil(size={"height": image, "width": image}),
            tokenizer=tok,
            image_seq_length=image_tokens,
            chat_template=GEMMA_TEMPLATE,
        )
    else:
        tok = _tokenizer(MISTRAL_SPECIALS, MISTRAL_TEMPLATE, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
        ids = {k: tok.convert_tokens_to_ids(t) for k, t in (("eos_token_id", "</s>"), ("pad_token_id", "<unk>"))}
        text |= {"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": None, **ids}
        config = Mistral3Config(
            text_config=text | text_shape,
            vision_config={**vision, "model_type": "pixtral", "head_dim": 16},
            spatial_merge_size=1,
            image_token_index=tok.convert_tokens_to_ids("[IMG]"),
            tie_word_embeddings=False,
            **ids,
        )
        model = Mistral3ForConditionalGeneration(config)
        # As the checkpoints ship it (PixtralProcessor's files; transformers' class itself needs torchvision): its
        # tokenizer, image processor and processor_config.json.
        processor = None
        tok.save_pretrained(directory)
        PixtralImageProcessorPil(size={"longest_edge": image}, patch_size=14).save_pretrained(directory)
        (directory / "processor_config.json").write_text(json.dumps(PIXTRAL))
    _randomize_vision(model, (model.model.vision_tower, model.model.multi_modal_projector))
    model.eval().save_pretrained(directory)
    if processor is not None:
        processor.save_pretrained(directory)
    return directory


def _qwen_checkpoint(name: str, directory: Path, text: dict, vision_shape: dict, max_tokens: int = 16) -> Path:
    """A tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 or Qwen3.5-MoE checkpoint as they ship: the conditional model, a tokenizer with
    Qwen's image tokens and chat template, and the image processor's preprocessor_config.json (Qwen2VLImageProcessor,
    images resized to between 4 and `max_tokens` merged patches, keeping their aspect, so that images of other shapes
    have other grids)."""
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    tok = _tokenizer(QWEN_SPECIALS, QWEN_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    token = tok.convert_tokens_to_ids
    ids = {"eos_token_id": token("<|im_end|>"), "pad_token_id": token("<|endoftext|>")}
    patch = 16 if name in ("qwen3_vl", "qwen3_5", "qwen3_5_moe") else 14
    # M-RoPE: each head's frequencies split among the temporal, height and width positions, in the checkpoints'
    # proportions (Qwen2-VL's 16, 24, 24 of 64; Qwen3-VL's 24, 20, 20).
    if name != "qwen3_vl":  # (Qwen2's head_dim is hidden_size / heads: 32 in the tests too)
        text = {k: v for k, v in text.items() if k != "head_dim"}
    half = (text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]) // 2
    side = half * 5 // 16 if name == "qwen3_vl" else half * 3 // 8
    section = [half - 2 * side, side, side] if name == "qwen3_vl" else [half // 4, side, half - half // 4 - side]
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    if name == "qwen3_vl":
        rope["mrope_interleaved"] = True
    text = text | {"num_hidden_layers": 4, "rope_parameters": rope, "bos_token_id": None, **ids}
    if name in ("qwen3_5", "qwen3_5_moe"):  # three recurrent layers (Gated DeltaNet) in four; its own M-RoPE sections
        text |= {"head_dim": 32, "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16}
        text |= {"linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rope_parameters": {"rope_theta": 10000.0}}
    tokens = {
        "image_token_id": token("<|image_pad|>"),
        "video_token_id": token("<|video_pad|>"),
        "vision_start_token_id": token("<|vision_start|>"),
        "vision_end_token_id": token("<|vision_end|>"),
    }
    common = {"depth": 2, "num_heads": 2, "patch_size": patch, "spatial_merge_size": 2, "temporal_patch_size": 2}
    if name == "qwen2_vl":
        vision = common | {"embed_dim": 32, "hidden_size": text["hidden_size"], "mlp_ratio": 2}
        config, cls = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    elif name == "qwen2_5_vl":
        vision = common | {"hidden_size": 32, "intermediate_size": 64, "out_hidden_size": text["hidden_size"]}
        vision |= {"window_size": 56, "fullatt_block_indexes": [1]}
        config, cls = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    elif name == "qwen3_vl":
        vision = common | {"hidden_size": 32, "intermediate_size": 64, "out_hidden_size": text["hidden_size"]}
        vision |= {"num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]}
        config, cls = Qwen3VLConfig, Qwen3VLForConditionalGeneration
    else:
        vision = common | {"hidden_size": 32, "intermediate_size": 64, "out_hidden_size": text["hidden_size"]}
        vision |= {"num_position_embeddings": 64}
        config, cls = Qwen3_5Config, Qwen3_5ForConditionalGeneration
        if name == "qwen3_5_moe":  # 4 experts, top 2, a shared one
            text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
            text |= {"shared_expert_intermediate_size": 64}
            config, cls = Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration
    torch.manual_seed(0)
    model = cls(config(text_config=text, vision_config=vision | vision_shape, tie_word_embeddings=False, **tokens))
    _randomize_vision(model, (model.model.visual,))
    model.eval().save_pretrained(directory)
    tok.save_pretrained(directory)
    unit = patch * 2  # a merged patch's side in pixels
    (directory / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(
                    name, "Qwen3VLProcessor"
                ),
                "min_pixels": 4 * unit * unit,
                "max_pixels": max_tokens * unit * unit,
                "patch_size": patch,
                "merge_size": 2,
                "temporal_patch_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
            }
        )
    )
    return directory


def _llava_checkpoint(directory: Path, text: dict, vision_shape: dict) -> Path:
    """A tiny LLaVA-1.5 checkpoint as llava-hf ships it (LlavaForConditionalGeneration: a CLIP vision tower, its
    second-to-last layer's patch features without the class token, projected; a Llama language model), with its
    tokenizer (`<image>`), chat template and processor (LlavaProcessor over the PIL CLIP-style image processor: each
    image resized and cropped to 56 x 56, 16 tokens)."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration, LlavaImageProcessorPil, LlavaProcessor

    tok = _tokenizer(LLAVA_SPECIALS, LLAVA_TEMPLATE, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.add_bos_token = True
    ids = {"eos_token_id": tok.convert_tokens_to_ids("</s>"), "pad_token_id": tok.convert_tokens_to_ids("<unk>")}
    text = {k: v for k, v in text.items() if k != "head_dim"} | {"model_type": "llama", "num_hidden_layers": 2, **ids}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 2}
    vision |= {"image_size": 56, "patch_size": 14, "projection_dim": 32, "model_type": "clip_vision_model"}
    config = LlavaConfig(
        text_config=text,
        vision_config=vision | vision_shape,
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    _randomize_vision(model, (model.model.vision_tower, model.model.multi_modal_projector))
    model.eval().save_pretrained(directory)
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=LLAVA_TEMPLATE,
    ).save_pretrained(directory)
    return directory


def _internvl_checkpoint(directory: Path, text: dict, vision_shape: dict) -> Path:
    """A tiny InternVL checkpoint as the "-hf" releases ship (InternVL3 and 3.5: InternVLForConditionalGeneration, a
    Qwen2 language model): its tokenizer with the image tokens (`<img>`, `</img>`, `<IMG_CONTEXT>`, named in its
    config), the image processor's preprocessor_config.json (GotOcr2ImageProcessor: each image cut into 1 to 4 tiles of
    56 x 56 by its aspect, a thumbnail beside them) and processor_config.json (4 tokens a tile: 16 patches, pixel
    shuffled by 0.5)."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    extra = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>"}
    extra["video_token"] = "<video>"
    tok = _tokenizer(
        INTERNVL_SPECIALS,
        INTERNVL_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=extra,
    )
    token = tok.convert_tokens_to_ids
    ids = {"eos_token_id": token("<|im_end|>"), "pad_token_id": token("<|endoftext|>")}
    text = {k: v for k, v in text.items() if k != "head_dim"} | {"num_hidden_layers": 2, "bos_token_id": None, **ids}
    text |= {"model_type": "qwen2"}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    vision |= {"image_size": [56, 56], "patch_size": [14, 14], **vision_shape}
    config = InternVLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token("<IMG_CONTEXT>"),
        image_seq_length=4,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = InternVLForConditionalGeneration(config)
    _randomize_vision(model, (model.model.vision_tower, model.model.multi_modal_projector))
    model.eval().save_pretrained(directory)
    tok.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "GotOcr2ImageProcessor",
                "processor_class": "InternVLProcessor",
                "size": {"height": 56, "width": 56},
                "crop_to_patches": True,
                "min_patches": 1,
                "max_patches": 4,
                "image_mean": [0.485, 0.456, 0.406],
                "image_std": [0.229, 0.224, 0.225],
            }
        )
    )
    (directory / "processor_config.json").write_text(
        json.dumps({"processor_class": "InternVLProcessor", "image_seq_length": 4})
    )
    return directory


def png(seed: int, size: tuple[int, int] = (64, 48)) -> bytes:
    """A PNG (`size` = (width, height)) of a 4 x 4 grid of random solid colours (`seed`): shapes that survive the
    vision tower's pooling, where pixel noise averages out to the same features for every image."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    grid = torch.randint(0, 256, (4, 4, 3), generator=g, dtype=torch.uint8)
    rows = torch.arange(size[1]) * 4 // size[1]
    cols = torch.arange(size[0]) * 4 // size[0]
    pixels = grid[rows][:, cols].numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


class Reference:
    """The conditional model as transformers computes it, on the processor's inputs."""

    def __init__(self, directory: Path, image_kwargs: dict | None = None):
        """`image_kwargs`: Qwen-VL's image processor's arguments (engine.mm_processor_kwargs)."""
        from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer, PixtralImageProcessorPil

        self.image_kwargs = image_kwargs or {}
        self.model = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32).eval()
        self.pixtral = self.model.config.model_type == "mistral3"
        self.qwen = self.model.config.model_type in QWEN_VL
        self.internvl = self.model.config.model_type == "internvl"
        if self.pixtral:  # PixtralProcessor needs torchvision: its layout built here, by token ids
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.image_processor = PixtralImageProcessorPil.from_pretrained(directory)
        elif self.qwen:  # so does Qwen2VLProcessor (its video processor)
            from transformers import Qwen2VLImageProcessorPil

            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
        elif self.internvl:  # and InternVLProcessor
            from transformers import GotOcr2ImageProcessorPil

            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            self.image_processor = GotOcr2ImageProcessorPil.from_pretrained(directory)
        else:
            self.processor = AutoProcessor.from_pretrained(directory)
            self.tokenizer = self.processor.tokenizer

    def inputs(self, text: str, images: list[bytes]) -> dict:
        from PIL import Image

        pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
        if self.qwen:
            return self._qwen_inputs(text, pictures)
        if self.internvl:
            return self._internvl_inputs(text, pictures)
        if not self.pixtral:
            return dict(
                self.processor(
                    text=[text], images=[pictures] if pictures else None, return_tensors="pt", add_special_tokens=False
                )
            )
        # Mistral 3: each [IMG] marker becomes rows of [IMG] (one per 14 pixels of the resized width), each ended by
        # [IMG_BREAK], the last by [IMG_END] (PixtralProcessor's layout), the text between tokenized as it is.
        img, brk, end = (self.tokenizer.convert_tokens_to_ids(t) for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
        pieces = text.split("[IMG]")
        ids = self.tokenizer(pieces[0], add_special_tokens=False)["input_ids"]
        out = {}
        if pictures:
            out = dict(self.image_processor(pictures, patch_size=14, return_tensors="pt"))
        for k, piece in enumerate(pieces[1:]):
            height, width = (int(x) // 14 for x in out["image_sizes"][k])
            layout = ([img] * width + [brk]) * height
            ids += layout[:-1] + [end] + self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        out["input_ids"] = torch.tensor([ids])
        out["attention_mask"] = torch.ones_like(out["input_ids"])
        return out

    def _qwen_inputs(self, text: str, pictures: list) -> dict:
        """Qwen-VL: each <|image_pad|> marker becomes one per merged patch of its image's grid (Qwen2VLProcessor's
        layout), the text between tokenized as it is; `mm_token_type_ids` marks the images' tokens, from which the
        model computes its M-RoPE positions (get_rope_index)."""
        image = self.model.config.image_token_id
        pieces = text.split(self.tokenizer.convert_ids_to_tokens(image))
        out = dict(self.image_processor(pictures, return_tensors="pt", **self.image_kwargs)) if pictures else {}
        ids = self.tokenizer(pieces[0], add_special_tokens=False)["input_ids"]
        for k, piece in enumerate(pieces[1:]):
            ids += [image] * (int(out["image_grid_thw"][k].prod()) // 4)
            ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        out["input_ids"] = torch.tensor([ids])
        out["attention_mask"] = torch.ones_like(out["input_ids"])
        out["mm_token_type_ids"] = (out["input_ids"] == image).int()
        return out

    def _internvl_inputs(self, text: str, pictures: list) -> dict:
        """InternVL: each <IMG_CONTEXT> marker becomes <img>, 4 <IMG_CONTEXT> a tile of its image, </img>
        (InternVLProcessor's layout), the text between tokenized as it is."""
        image = self.model.config.image_token_id
        start, end = (self.tokenizer.convert_tokens_to_ids(t) for t in ("<img>", "</img>"))
        pieces = text.split(self.tokenizer.convert_ids_to_tokens(image))
        out = dict(self.image_processor(pictures, return_tensors="pt", **self.image_kwargs)) if pictures else {}
        tiles = out.pop("num_patches", [])
        ids = self.tokenizer(pieces[0], add_special_tokens=False)["input_ids"]
        for k, piece in enumerate(pieces[1:]):
            ids += [start] + [image] * (self.model.config.image_seq_length * int(tiles[k])) + [end]
            ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        out["input_ids"] = torch.tensor([ids])
        out["attention_mask"] = torch.ones_like(out["input_ids"])
        return out

    def greedy(self, text: str, images: list[bytes], new_tokens: int) -> list[int]:
        """The greedy continuation of a rendered chat `text` with `images` (generate)."""
        inputs = self.inputs(text, images)
        with torch.no_grad():
            out = self.model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    def logprobs(
        self, text: str, images: list[bytes], continuation: list[int], *, causal: bool = False, flat: bool = False
    ):
        """`[len(continuation), vocab]`: the log-probabilities at each token of `continuation` after the prompt
        (teacher-forced). `causal`: without Gemma 3's token_type_ids (its images attended causally). `flat`: Qwen-VL
        rotated by each token's position alone, not M-RoPE's (the images' tokens by their place in the image)."""
        inputs = self.inputs(text, images)
        n = inputs["input_ids"].shape[1]
        extra = torch.tensor([continuation[:-1]], dtype=inputs["input_ids"].dtype)
        inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if causal:
            inputs.pop("token_type_ids", None)
        elif "token_type_ids" in inputs:
            inputs["token_type_ids"] = torch.cat([inputs["token_type_ids"], torch.zeros_like(extra)], dim=1)
        if "mm_token_type_ids" in inputs:
            inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra).int()], dim=1)
            if flat:
                inputs["position_ids"] = torch.arange(inputs["input_ids"].shape[1])[None]
        with torch.no_grad():
            logits = self.model(**inputs).logits[0, n - 1 :].float()
        return logits.log_softmax(-1)


def render(directory: Path, messages: list[dict]) -> str:
    """The chat text of `messages` (image parts as {"type": "image"}) through the checkpoint's template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
