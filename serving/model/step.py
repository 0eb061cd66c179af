"""The plain data the engine hands the model executor each step, as vLLM v1 hands its runner a SchedulerOutput: token
ids, positions and KV block ids, never the engine's own Request objects, so the executor never imports the engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepSequence:
    """One sequence's part of a step."""

    token_ids: list[int]  # the tokens this step computes, at positions start, start + 1, ...
    start: int  # the position of the first of them (the tokens before it are in the KV cache)
    block_table: list[int]  # the sequence's KV block ids, in order
    samples: bool  # the step computes the sequence's last known token, so its logits are returned
    # The logits of every token this step computes for the sequence are returned, not only the last one's (a prompt
    # whose tokens' log-probabilities were asked for: the logits at position p score the token at p + 1).
    prompt_logits: bool = False
    # Which LoRA adapter the sequence runs with: 0 the base model alone, k >= 1 the k-th of the runner's `adapters`
    # (`ModelRunner(adapters=...)`; pylon.serving.model.lora). Sequences of different adapters share a step.
    adapter: int = 0
    # The sequence is embedded, not sampled: when it `samples` (its prompt's last chunk), its last token's final
    # hidden state (after the last norm) is returned instead of logits (`ModelRunner.execute_step`).
    pooled: bool = False
    # A pooled sequence of an encoder with token heads: its tokens' outputs instead (SamplingParams.pool_task)
    pool_task: str = ""
    # Images (pylon.serving.engine.images): the offsets among this step's tokens whose embeddings are `image_embeds`'
    # rows (the vision tower's, `[len(image_rows), hidden]`) in place of their placeholder tokens', and the runs of
    # positions attended both ways (Gemma 3's images) that the step reaches into.
    image_rows: tuple[int, ...] = ()
    image_embeds: object = None
    image_spans: tuple[tuple[int, int], ...] = ()
    # M-RoPE (a Qwen-VL prompt with images: pylon.serving.engine.images.ImageInputs.mrope): the rotary positions
    # `[3, p]` of the sequence's first p positions, and the offset of every later one (position + offset, all three);
    # None: each token is rotated by its position.
    mrope: tuple | None = None
    # A model with recurrent layers (families.LINEAR_ATTENTION_FAMILIES): the key of the sequence's state there (its
    # request's id); a sequence that starts at position 0 starts its state afresh (a new prompt, or one recomputed).
    state: str | None = None
    # Speculative decoding: the tokens after the first are drafts, which the engine may reject. A recurrent layer keeps
    # its state after each of them, to go back to the last one accepted (`ModelRunner.keep_state`).
    speculative: bool = False
    # A draft tree (engine.speculative.tree_width): each of this step's tokens' parent among them (-1 for the first,
    # the last known token). A token sits at its parent's position + 1 and attends to the cache and its own
    # ancestors only; its keys and values go to the slot of its index (start + i), whatever its position, until the
    # engine moves the accepted path's into place (`ModelRunner.move_kv`). Empty: one path, token i at start + i.
    tree: tuple[int, ...] = ()
    # The KV cache in groups of layers (ModelRunner.kv_groups): each group's block ids, in order (the first is
    # `block_table`); empty where every layer's are `block_table`.
    group_tables: tuple[list[int], ...] = ()

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)
