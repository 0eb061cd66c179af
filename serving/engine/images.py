"""Images in chat prompts, for the multimodal checkpoints the engine serves (families.IMAGE_MODELS: Gemma 3 4B-27B,
Mistral Small 3.1 and 3.2, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, InternVL's "-hf" releases and LLaVA-1.5).

A chat request's image parts reach the engine as an `ImagePrompt`: the text its chat template rendered (one image
marker where each image goes: Gemma 3's `<start_of_image>`, Mistral's `[IMG]`, Qwen's `<|image_pad|>`, InternVL's
`<IMG_CONTEXT>`, LLaVA's `<image>`) and the
images' files. The engine runs the checkpoint's own processor (`transformers.AutoProcessor`, as vLLM does): it
expands each marker into the image's placeholder tokens and turns each image into the vision tower's pixels. The
vision tower and projector run once per request, when its prompt is first computed (`ModelRunner.embed_images`); their
rows replace the placeholders' embeddings, chunk by chunk (`ImageInputs.rows`).

What differs from text:

- The prefix cache must not take one image's keys and values for another's: the placeholders are the same tokens
  for every image. Block hashes read each placeholder as a key of its image's contents and place in it
  (`ImageInputs.hash_ids`: negative ids, which no token has), so requests that share a text and an image share their
  blocks, and a different image shares the text before it only.
- Gemma 3 attends an image's placeholders both ways while it reads the prompt (transformers' token_type_ids mask):
  `ImageInputs.spans` are those runs; a prompt chunk never ends inside one (the scheduler cuts it before), and the
  chunk's mask lets a run's queries see the whole run (pylon.serving.model.attention).
- Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 rotate each token by three positions (M-RoPE: temporal, height, width): an
  image's tokens by their row and column in it, from the position after the text before it; the text after an image
  goes on from there plus the image's larger side, not its token count. `ImageInputs.mrope` holds the prompt's three
  positions up to its last image and the offset every later token's takes (`mrope_positions`, the model's
  `get_rope_index` for images); each step hands them to the runner (StepSequence.mrope), which rotates by them.

Decoding images: PNG, JPEG, WebP and GIF (the first frame), as data: URLs only. The replica fetches nothing from the
network for a request (no request can make a replica read an internal address).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import hashlib
import io
import itertools
import os
import re
from dataclasses import dataclass, field

from pylon.serving.errors import InvalidRequest
from pylon.serving.model.families import MROPE_MODELS

# Gemma 3 attends each image's tokens both ways in its prompt (Gemma3Model's bidirectional block mask).
BIDIRECTIONAL_IMAGES = frozenset({"gemma3"})
IMAGE_FORMATS = ("png", "jpeg", "webp", "gif")
MAX_IMAGE_PIXELS = 40_000_000  # a decompression bomb is refused before it is decoded (PIL's own limit is ~89M)
_DATA_URL = re.compile(r"data:image/(png|jpeg|jpg|webp|gif);base64,", re.IGNORECASE)
_KEY_MASK = (1 << 62) - 1


@dataclass(frozen=True)
class ImagePrompt:
    """A chat prompt with images: the chat template's text, with one image marker for each of `images` (their
    files' bytes, in the order the messages give them)."""

    text: str
    images: tuple[bytes, ...]


def image_bytes(url: object, where: str) -> bytes:
    """The image file a request's `image_url` holds (a data: URL of a PNG, JPEG, WebP or GIF), checked to be an image
    PIL can read of at most MAX_IMAGE_PIXELS; an InvalidRequest naming `where` (the part's field path) otherwise."""
    if not isinstance(url, str):
        raise InvalidRequest(f"{where}: an image URL is a string (a data: URL)", param=where)
    found = _DATA_URL.match(url)
    if found is None:
        if url.startswith(("http://", "https://")):
            raise InvalidRequest(
                f"{where}: images are taken inline only: this server fetches nothing from the network for a request. "
                "Send the file as a data URL (data:image/png;base64,...)",
                param=where,
            )
        raise InvalidRequest(
            f"{where}: not an image data URL; send data:image/<png|jpeg|webp|gif>;base64,<the file in base64>",
            param=where,
        )
    try:
        data = base64.b64decode(url[found.end() :], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: the data URL's base64 does not decode", param=where) from None
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            kind = (image.format or "").lower()
            if width * height > MAX_IMAGE_PIXELS:
                raise InvalidRequest(
                    f"{where}: the image is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS:,} are taken",
                    param=where,
                )
            image.verify()
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise InvalidRequest(f"{where}: not a readable image ({type(e).__name__}: {e})", param=where) from None
    if kind not in IMAGE_FORMATS:
        raise InvalidRequest(f"{where}: a {kind or 'unknown'} image; send PNG, JPEG, WebP or GIF", param=where)
    return data


@dataclass
class ImageInputs:
    """What the engine keeps of a request's images: the vision tower's inputs, where their rows go in the prompt, and
    how its blocks are hashed."""

    pixels: dict  # the processor's tensors the vision tower takes (pixel_values; Pixtral's image_sizes; Qwen's grids)
    positions: list[int]  # the prompt positions whose embeddings are the images' rows, in order
    keys: list[int]  # each of those positions' key in the block hashes (its image's digest and its place in it)
    spans: list[tuple[int, int]] = field(default_factory=list)  # runs attended both ways (Gemma 3), [start, end)
    count: int = 0  # images
    # M-RoPE (families.MROPE_MODELS): the rotary positions `[3, p]` of the prompt's first p tokens (up to its last
    # image's end), and what position p' >= p is rotated by: p' + offset, all three (`mrope_positions`).
    mrope: tuple | None = None

    def hash_ids(self, token_ids: list[int], hashed: int = 0) -> list[int]:
        """`token_ids` with each image position's key in place of its placeholder token (for block hashes only).
        `hashed`: the tokens whose blocks are hashed already; once they are past the last image, `token_ids` as they
        are (no copy: a decode fills a block every block_size steps)."""
        if hashed > self.last_position:
            return token_ids
        ids = list(token_ids)
        for p, key in zip(self.positions, self.keys):
            ids[p] = key
        return ids

    def rows(self, start: int, num_new: int) -> tuple[list[int], int, int]:
        """The image rows a step computing positions start .. start + num_new - 1 takes: their offsets within the
        step's tokens, and the range [first, last) of the images' rows (in `positions`' order) they are."""
        first = bisect.bisect_left(self.positions, start)
        last = bisect.bisect_left(self.positions, start + num_new)
        return [p - start for p in self.positions[first:last]], first, last

    def spans_in(self, start: int, num_new: int) -> tuple[tuple[int, int], ...]:
        """The bidirectional runs that the positions start .. start + num_new - 1 reach into."""
        end = start + num_new
        return tuple((a, b) for a, b in self.spans if a < end and b > start)

    def cut(self, start: int, num_new: int) -> int:
        """How many of num_new prompt tokens from `start` a step may compute: a chunk that would end inside a
        bidirectional run stops before it, or takes nothing (0) when it starts inside that run (it waits for a step
        whose budget takes the run to its end)."""
        end = start + num_new
        for a, b in self.spans:
            if a < end < b:
                return a - start if a > start else 0
        return num_new

    @property
    def last_position(self) -> int:
        return self.positions[-1] if self.positions else -1


class _ExpandingProcessor:
    """A multimodal processor made of the checkpoint's image processor (its PIL backend) and tokenizer, for the
    families whose transformers processor needs torchvision: each image marker the chat template placed
    (`image_token`) is replaced by that image's placeholders (`_expand`), and the whole text tokenized at once."""

    image_processor: object
    tokenizer: object
    image_token: str
    outputs: tuple[str, ...] = ("pixel_values",)  # the image processor's tensors the vision tower takes

    def _pixels(self, images: list, return_tensors: str, kwargs: dict) -> dict:
        return self.image_processor(images, return_tensors=return_tensors, **kwargs)

    def _expand(self, pixels: dict) -> list[str]:
        """Each image's placeholders, in order."""
        raise NotImplementedError

    def __call__(
        self, *, text: list[str], images: list[list], return_tensors: str, add_special_tokens: bool, **kwargs
    ) -> dict:
        pixels = self._pixels(images[0], return_tensors, kwargs)
        pieces = text[0].split(self.image_token)
        if len(pieces) - 1 != len(images[0]):
            raise ValueError(f"the prompt has {len(pieces) - 1} {self.image_token} markers for {len(images[0])} images")
        expanded = [pieces[0]]
        for placeholders, piece in zip(self._expand(pixels), pieces[1:]):
            expanded.append(placeholders + piece)
        ids = self.tokenizer("".join(expanded), add_special_tokens=add_special_tokens, return_tensors=return_tensors)
        return {"input_ids": ids["input_ids"], **{k: pixels[k] for k in self.outputs}}


class PixtralProcessor(_ExpandingProcessor):
    """Mistral 3's processor (transformers' PixtralProcessor), whose transformers 5.23 module needs torchvision, which
    Pylon does not install: the checkpoint's image processor with its PIL backend (PixtralImageProcessorPil) and its
    tokenizer, each image's `[IMG]` marker expanded as PixtralProcessor expands it: a row of `[IMG]` per
    (patch_size x spatial_merge_size) pixels of its resized height, each row as wide as its width and ended by
    `[IMG_BREAK]`, the last one by `[IMG_END]`."""

    outputs = ("pixel_values", "image_sizes")

    def __init__(self, model_dir: str):
        import json

        from transformers import AutoTokenizer, PixtralImageProcessorPil

        with open(os.path.join(model_dir, "processor_config.json")) as f:
            config = json.load(f)
        self.image_processor = PixtralImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.patch = int(config.get("patch_size", 16)) * int(config.get("spatial_merge_size", 1))
        self.image_token = config.get("image_token", "[IMG]")
        self.image_break = config.get("image_break_token", "[IMG_BREAK]")
        self.image_end = config.get("image_end_token", "[IMG_END]")

    def _pixels(self, images: list, return_tensors: str, kwargs: dict) -> dict:
        return self.image_processor(images, **({"patch_size": self.patch} | kwargs), return_tensors=return_tensors)

    def _expand(self, pixels: dict) -> list[str]:
        expanded = []
        for height, width in pixels["image_sizes"].tolist():
            rows = [self.image_token * (width // self.patch) + self.image_break] * (height // self.patch)
            expanded.append("".join(rows)[: -len(self.image_break)] + self.image_end)
        return expanded


class QwenVLProcessor(_ExpandingProcessor):
    """Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's and Qwen3.5's processor (transformers' Qwen2VLProcessor and its kin, whose
    transformers 5.23 classes need torchvision for their video processor, which Pylon does not install): the
    checkpoint's image processor with its PIL backend (Qwen2VLImageProcessorPil: each image resized to a multiple of
    patch_size x merge_size within min_pixels .. max_pixels, cut into patches) and its tokenizer, each `<|image_pad|>`
    expanded as Qwen2VLProcessor expands it: one per merged patch (grid t x h x w / merge_size^2)."""

    outputs = ("pixel_values", "image_grid_thw")

    def __init__(self, model_dir: str, config):
        from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.image_token = self.tokenizer.convert_ids_to_tokens(config.image_token_id)
        self.merge_size = int(self.image_processor.merge_size)  # merged patches a side, a token

    def _expand(self, pixels: dict) -> list[str]:
        return [self.image_token * n for n in self.tokens(pixels)]

    def tokens(self, pixels: dict) -> list[int]:
        """Each image's placeholders: its grid's patches, merge_size x merge_size a token."""
        return [t * h * w // self.merge_size**2 for t, h, w in pixels["image_grid_thw"].tolist()]


class InternVLProcessor(_ExpandingProcessor):
    """InternVL's processor (transformers' InternVLProcessor, whose video processor needs torchvision): the
    checkpoint's image processor with its PIL backend (GotOcr2ImageProcessorPil: each image cut into tiles of its
    configured size by its aspect, within min_patches..max_patches, a thumbnail beside them when there are several)
    and its tokenizer, each `<IMG_CONTEXT>` the chat template placed expanded as InternVLProcessor expands it:
    `<img>`, then `image_seq_length` of it a tile, then `</img>`."""

    outputs = ("pixel_values", "num_patches")

    def __init__(self, model_dir: str, config):
        import json

        from transformers import AutoTokenizer, GotOcr2ImageProcessorPil

        self.image_processor = GotOcr2ImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        self.image_token = self.tokenizer.convert_ids_to_tokens(config.image_token_id)
        self.start = getattr(self.tokenizer, "start_image_token", None) or "<img>"
        self.end = getattr(self.tokenizer, "end_image_token", None) or "</img>"
        self.per_tile = int(config.image_seq_length)
        path = os.path.join(model_dir, "processor_config.json")
        if os.path.exists(path):
            with open(path) as f:
                self.per_tile = int(json.load(f).get("image_seq_length", self.per_tile))

    def _expand(self, pixels: dict) -> list[str]:
        return [self.start + self.image_token * (self.per_tile * int(n)) + self.end for n in pixels["num_patches"]]


def mrope_positions(starts: list[int], grids: list[tuple[int, int, int]], merge: int) -> tuple:
    """M-RoPE's rotary positions of a prompt whose images' tokens begin at `starts` (each image's t x h x w grid of
    patches, `merge` x `merge` patches a token), as Qwen2-VL's `get_rope_index` computes them for images: a text
    token's three positions are one, each after the last; an image's tokens are at (s + t, s + row, s + column), s the
    position after the text before it; the text after it goes on from s + max(its rows, its columns). Returns the
    positions `[3, p]` of the first p tokens, p the end of the last image, and the offset every later position takes
    (its rotary position is position + offset: the model's `rope_deltas`)."""
    import torch

    pieces, at, now = [], 0, 0  # the tensors so far, the next token, its (first) rotary position
    for start, (t, h, w) in zip(starts, grids):
        if start > at:  # the text before the image
            pieces.append(torch.arange(now, now + start - at).expand(3, -1))
            now += start - at
        h, w = h // merge, w // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        pieces.append(grid.reshape(3, -1) + now)
        now += max(h, w)
        at = start + t * h * w
    table = torch.cat(pieces, dim=1) if pieces else torch.empty(3, 0, dtype=torch.long)
    return table, now - at


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


class ImageProcessor:
    """A multimodal checkpoint's processor (its image processor and its tokenizer, as it ships), for the engine."""

    def __init__(self, model_dir: str, config, max_images: int, kwargs: dict | None = None):
        from transformers import AutoProcessor

        from pylon.errors import PylonError

        try:
            if config.model_type == "mistral3":
                self.processor = PixtralProcessor(model_dir)
            elif config.model_type in MROPE_MODELS:
                self.processor = QwenVLProcessor(model_dir, config)
            elif config.model_type == "internvl":
                self.processor = InternVLProcessor(model_dir, config)
            else:
                self.processor = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        except Exception as e:
            raise PylonError(
                f"model {model_dir}: its image processor cannot be loaded ({type(e).__name__}: {str(e)[:300]}); a "
                "multimodal checkpoint ships processor_config.json and preprocessor_config.json beside its tokenizer "
                "(copy them from the checkpoint), or set engine.max_images_per_prompt: 0 to serve its text only"
            ) from None
        self.kwargs = dict(kwargs or {})  # engine.mm_processor_kwargs: the image processor's, every request
        if self.kwargs:
            self._check_kwargs()
        self.model_type = config.model_type
        self.image_token_id = config.image_token_id
        self.bidirectional = self.model_type in BIDIRECTIONAL_IMAGES
        self.mrope = self.model_type in MROPE_MODELS
        self.max_images = max_images
        # Pixtral (Mistral 3): an image's rows, one per (patch_size * spatial_merge_size) square of its resized size.
        patch = getattr(config.vision_config, "patch_size", 1)
        self._per_row = patch * getattr(config, "spatial_merge_size", 1)

    def _check_kwargs(self) -> None:
        """engine.mm_processor_kwargs, tried on a test image: the processor's refusal (a name it does not take, a value
        of another type) fails the engine's start naming the field, not each request."""
        from PIL import Image

        from pylon.errors import PylonError

        try:
            self.processor.image_processor([Image.new("RGB", (64, 48))], return_tensors="pt", **self.kwargs)
        except Exception as e:
            raise PylonError(
                f"engine.mm_processor_kwargs {sorted(self.kwargs)}: the model's image processor "
                f"({type(self.processor.image_processor).__name__}) refuses them ({type(e).__name__}: "
                f"{str(e).strip()[:300]}); give the names and types it takes (Qwen-VL: max_pixels, min_pixels)"
            ) from None

    def prepare(self, prompt: ImagePrompt, special: bool = False) -> tuple[list[int], ImageInputs]:
        """The prompt's token ids (each image marker expanded into its placeholders) and its images' inputs."""
        from PIL import Image

        if len(prompt.images) > self.max_images:
            raise InvalidRequest(
                f"the request has {len(prompt.images)} images; this deployment takes at most {self.max_images} "
                "(engine.max_images_per_prompt)",
                param="messages",
            )
        images = []
        for k, data in enumerate(prompt.images):
            try:
                with Image.open(io.BytesIO(data)) as image:
                    image.seek(0)  # a GIF's first frame
                    images.append(image.convert("RGB"))
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:  # truncated past its header
                raise InvalidRequest(
                    f"messages: image {k + 1} of the request cannot be decoded ({type(e).__name__}: {e})",
                    param="messages",
                ) from None
        try:
            out = self.processor(
                text=[prompt.text], images=[images], return_tensors="pt", add_special_tokens=special, **self.kwargs
            )
        except ValueError as e:  # e.g. the template placed fewer image markers than there are images
            raise InvalidRequest(f"messages: the images do not fit the prompt ({e})", param="messages") from None
        ids = out["input_ids"][0].tolist()
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        pixels = {k: out[k] for k in ("pixel_values", "image_sizes", "image_grid_thw", "num_patches") if k in out}
        counts = self._rows_per_image(pixels, len(images))
        if sum(counts) != len(positions):
            raise InvalidRequest(
                f"messages: the prompt has {len(positions)} image placeholders for {len(images)} images of "
                f"{sum(counts)} rows (does the model's chat template place each image once?)",
                param="messages",
            )
        keys = []
        for data, count in zip(prompt.images, counts):
            digest = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
            keys.extend(-1 - ((digest + j) & _KEY_MASK) for j in range(count))
        spans = _runs(positions) if self.bidirectional else []
        mrope = None
        if self.mrope:  # each image's first placeholder, and its grid
            starts = list(itertools.accumulate(counts[:-1], initial=0))
            grids = [tuple(g) for g in pixels["image_grid_thw"].tolist()]
            mrope = mrope_positions([positions[s] for s in starts], grids, self.processor.merge_size)
        return ids, ImageInputs(pixels, positions, keys, spans, len(images), mrope)

    def _rows_per_image(self, pixels: dict, n: int) -> list[int]:
        if "num_patches" in pixels:  # InternVL: its tiles, image_seq_length tokens each
            return [int(n) * self.processor.per_tile for n in pixels["num_patches"]]
        if "image_grid_thw" in pixels:  # Qwen: its grid of patches, merge_size x merge_size a token
            return self.processor.tokens(pixels)
        if "image_sizes" in pixels:  # Pixtral: its resized height and width, in merged patches
            return [int(h) // self._per_row * (int(w) // self._per_row) for h, w in pixels["image_sizes"].tolist()]
        per = getattr(self.processor, "image_seq_length", None)
        if per is None and hasattr(self.processor, "num_additional_image_tokens"):  # LLaVA: a token a patch
            patch = self.processor.patch_size
            height, width = pixels["pixel_values"].shape[-2:]
            per = (height // patch) * (width // patch) + self.processor.num_additional_image_tokens
            per -= self.processor.vision_feature_select_strategy == "default"  # (the class token's row dropped)
        if per is None or len(pixels["pixel_values"]) != n:
            raise InvalidRequest(
                f"messages: the model's processor made {len(pixels['pixel_values'])} images of {n}", param="messages"
            )
        return [per] * n
