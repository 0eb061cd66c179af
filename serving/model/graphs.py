"""Steps of decodes only, replayed from captured CUDA graphs.

On a GPU a small model's decode step is host work: dozens of kernel launches per layer, each finished before the next
is launched. A CUDA graph records a whole step's launches once and replays them with one call, as vLLM and gpt-fast
do. A graph replays fixed shapes at fixed addresses, so a step of B decodes runs as `b` rows (the smallest of
`batch_sizes` >= B) over `nb` blocks per sequence (the smallest of `block_counts` that holds the longest context):

- rows past B are token 0 at position 0 with one key, stored in a scratch block the pool never hands out
  (`ModelRunner.add_scratch_block`);
- block tables are padded with block 0, and the attention bias is made inside the graph from the context lengths
  (with the model's sliding window where it has one: a second bias for its windowed layers where they mix with full
  ones, as `ModelRunner.execute_step` builds a second metadata); where the KV cache is in groups of layers
  (`ModelRunner.kv_groups`), each group's slots and tables too, and a bias for each windowed group.

The step is the eager path's arithmetic, so a graph computes what the eager step computes. Steps with a prompt chunk,
or larger than any graph, run eagerly. Every shape is captured at start-up (`capture_all`, largest first); shapes
whose gathered keys and values would pass `GATHER_BYTES` are left to the eager path. All graphs share one memory pool
and one logits buffer (a step replays one graph and takes its logits before the next). `engine.cuda_graphs: false`
turns graphs off; with `capture=False` the same fixed-shape step runs eagerly, which is how the tests check it on a
CPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from pylon.serving.model.attention import (
    AttentionGroup,
    AttentionMetadata,
    Final,
    Workspace,
    decode_mask,
    padded_tables,
)
from pylon.serving.model.step import StepSequence

GATHER_BYTES = 1 << 30  # the most a graph's step may gather of keys and values (bytes, all of a layer's heads)


def batch_sizes(max_num_seqs: int) -> list[int]:
    """Row counts a graph is captured for: 1, 2, 4, 8, then multiples of 8 (vLLM's sizes), up to `max_num_seqs`."""
    sizes = [n for n in (1, 2, 4) if n < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def block_counts(max_blocks: int) -> list[int]:
    """Blocks per sequence a graph attends over: powers of two from 4 (a gather at most twice what the step
    needs), up to the most a sequence can have."""
    counts, n = [], 4
    while n < max_blocks:
        counts.append(n)
        n *= 2
    return counts + [max_blocks]


def _smallest_at_least(options: Sequence[int], n: int) -> int | None:
    return next((o for o in options if o >= n), None)


@dataclasses.dataclass
class _Graph:
    """One captured shape: its input tensors (filled before each replay) and its output."""

    inputs: torch.Tensor  # [4 * b + b * nb] int64: ids, positions, slots, context lengths, block tables
    logits: torch.Tensor  # [b, vocab] float32, written by each replay (rows of the graphs' shared buffer)
    replay: Callable[[], object]  # the graph's replay (or, with capture=False, the step itself)
    # The step, which holds the tensors the graph reads besides `inputs` (its bias, its key and row indices): a graph
    # keeps no reference to them, and freed, their memory would go to other tensors.
    step: Callable[[], torch.Tensor]


class DecodeGraphs:
    """Decode-only steps of `runner` (a `ModelRunner` with its scratch block) in fixed shapes, captured as CUDA graphs
    (`capture`) or run eagerly."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int, *, capture: bool = True):
        if runner.scratch_slot is None:
            raise ValueError("DecodeGraphs needs the runner's scratch block (ModelRunner.add_scratch_block)")
        self.runner = runner
        self.capture = capture
        self.sizes = batch_sizes(max_num_seqs)
        self.block_counts = block_counts(-(-max_model_len // runner.block_size))
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.logits = torch.empty(self.sizes[-1], runner.vocab_size, dtype=torch.float32, device=runner.device)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # steps replayed (or run, with capture=False) from a fixed shape

    def gather_bytes(self, b: int, nb: int) -> int:
        """Keys and values a step of shape (b, nb) gathers in each layer, in bytes."""
        num_kv_heads, _, block_size, head_dim = self.runner.k_cache[0].shape
        return 2 * num_kv_heads * b * nb * block_size * head_dim * self.runner.dtype.itemsize

    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, blocks per sequence) a graph is made for, largest first."""
        return sorted(
            ((b, nb) for b in self.sizes for nb in self.block_counts if self.gather_bytes(b, nb) <= GATHER_BYTES),
            reverse=True,
        )

    def capture_all(self) -> int:
        """Make every shape's graph (largest first, so that the smaller ones reuse its memory); returns how many."""
        for b, nb in self.shapes():
            if (b, nb) not in self.graphs:
                self.graphs[b, nb] = self._build(b, nb)
        return len(self.graphs)

    def shape_for(self, num_seqs: int, max_context: int) -> tuple[int, int] | None:
        """(rows, blocks per sequence) of the graph for a step of `num_seqs` decodes whose longest context is
        `max_context` keys, or None when no graph holds it."""
        b = _smallest_at_least(self.sizes, num_seqs)
        nb = _smallest_at_least(self.block_counts, -(-max_context // self.runner.block_size))
        return None if b is None or nb is None or (b, nb) not in self.graphs else (b, nb)

    @torch.no_grad()
    def run(self, steps: Sequence[StepSequence]) -> torch.Tensor | None:
        """Float32 logits `[len(steps), vocab]` for a step of decodes only (every sequence one new token, and
        sampling), or None when no graph holds the step (the caller runs it eagerly)."""
        block_size = self.runner.block_size
        block_tables = [s.block_table for s in steps]
        starts = [s.start for s in steps]
        shape = self.shape_for(len(steps), max(starts) + 1)
        if shape is None:
            return None
        b, nb = shape
        graph = self.graphs[shape]
        pad = b - len(steps)
        ids = [s.token_ids[0] for s in steps] + [0] * pad
        # The rows' rotary positions: a Qwen-VL decode past its prompt's images rotates by position + its M-RoPE
        # offset, all three positions alike, which is the plain rotation of that one position.
        rotary = [s.start + s.mrope[1] if s.mrope is not None else s.start for s in steps]
        slots = [table[p // block_size] * block_size + p % block_size for table, p in zip(block_tables, starts)]
        groups = []  # the KV cache's other groups' slots and tables (ModelRunner.kv_groups)
        for g in range(1, len(self.runner.kv_groups)):
            tables = [s.group_tables[g] for s in steps]
            groups += [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, starts)]
            groups += [self.runner.scratch_slot] * pad + padded_tables(tables, nb) + [0] * (pad * nb)
        # One copy from page-locked memory (ModelRunner.stage): a pageable one costs the host ~65 us more.
        self.runner.stage.upload(
            graph.inputs,
            ids
            + rotary
            + [0] * pad
            + slots
            + [self.runner.scratch_slot] * pad
            + [p + 1 for p in starts]
            + [1] * pad
            + padded_tables(block_tables, nb)
            + [0] * (pad * nb)
            + groups,
        )
        graph.replay()
        self.replays += 1
        return graph.logits[: len(steps)]

    @torch.no_grad()  # capture_all runs at engine start, outside the step's no_grad: a graph records no autograd
    def _build(self, b: int, nb: int) -> _Graph:
        runner = self.runner
        device, dtype = runner.device, runner.dtype
        extra = len(runner.kv_groups) - 1 if runner.kv_groups else 0  # the KV cache's other groups: their slots, tables
        inputs = torch.zeros((4 + extra) * b + (1 + extra) * b * nb, dtype=torch.long, device=device)
        ids, positions, slots, context_lens = (inputs[i * b : (i + 1) * b] for i in range(4))
        table = inputs[4 * b : 4 * b + b * nb].view(b, nb)
        slots.fill_(runner.scratch_slot)
        context_lens.fill_(1)
        num_keys = nb * runner.block_size
        keys = torch.arange(num_keys, device=device)
        bias = torch.zeros(b, 1, num_keys, dtype=dtype, device=device)
        rows = torch.arange(b, device=device)
        group = AttentionGroup(
            query_index=rows.view(b, 1),
            real=rows,
            tokens=rows,
            key_blocks=table.view(-1),
            num_blocks=nb,
            num_keys=num_keys,
            bias=bias,
            context_lens=context_lens,
        )
        window, mixed = runner.step_window, runner.mixed_window  # see ModelRunner.layer_windows
        if runner.kv_groups:  # (each group's own metadata instead: below)
            mixed = None
        windowed = None
        if mixed is not None:  # the windowed layers' group: the same, but for its bias
            mixed_bias = torch.zeros_like(bias)
            windowed = AttentionMetadata(slots, [dataclasses.replace(group, bias=mixed_bias)], window=mixed)
        meta = AttentionMetadata(slots, [group], window=window, windowed=windowed)
        group_biases = []
        if extra:  # each group's own slots and table, and its own bias where it has a window
            metas = [None]
            for g in range(1, len(runner.kv_groups)):
                at = 4 * b + b * nb + (g - 1) * (b + b * nb)
                g_slots, g_table = inputs[at : at + b], inputs[at + b : at + b + b * nb]
                g_window = runner.kv_groups[g][1]
                g_bias = torch.zeros_like(bias) if g_window is not None else bias
                if g_window is not None:
                    group_biases.append((g_bias, g_window))
                g_group = dataclasses.replace(group, key_blocks=g_table, bias=g_bias)
                metas.append(AttentionMetadata(g_slots, [g_group], window=g_window))
            meta = dataclasses.replace(meta, kv_groups=tuple(metas))
        final = Final(None, meta.over_cache())

        logits = self.logits[:b]

        def step() -> torch.Tensor:
            bias.zero_().masked_fill_(decode_mask(keys, context_lens, window), float("-inf"))
            if mixed is not None:
                mixed_bias.zero_().masked_fill_(decode_mask(keys, context_lens, mixed), float("-inf"))
            for g_bias, g_window in group_biases:
                g_bias.zero_().masked_fill_(decode_mask(keys, context_lens, g_window), float("-inf"))
            hidden = runner.forward(ids, positions, meta, final, Workspace())
            return logits.copy_(runner.logits(hidden))

        if not self.capture:
            step()  # the warm-up a capture runs first, so that a CPU test goes through what a GPU's start does
            return _Graph(inputs, logits, step, step)
        # Warm up on a side stream first (cuBLAS picks its kernels and allocates its workspace there, outside the
        # capture), as torch.cuda.graphs' documentation asks.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the engine steps on a thread of its own; other threads' CUDA calls must not fail the capture.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            step()
        return _Graph(inputs, logits, graph.replay, step)
