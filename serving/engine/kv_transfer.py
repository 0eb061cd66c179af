"""A prompt's KV blocks sent from one engine to another: prefill-decode disaggregation (vLLM's disaggregated
prefilling through its KV connectors, SGLang's PD disaggregation, Ray Serve LLM's `build_pd_openai_app`).

A prefill engine computes a prompt (a request of one token, `SamplingParams.kv_export_from` set) and, in the same
step that finishes it, reads the prompt's full blocks out of its cache (`export_blocks`): their names, the prefix
cache's hashes, and every layer's keys and values of them, as bytes (`KVTransfer`). A decode engine, given the
transfer with a request (`SamplingParams.kv_import`), takes in the blocks before it schedules anything
(`import_blocks`): each block it lacks gets a free block, registered under the block's name, and the bytes written
into it. The request then finds its prompt as a cached prefix, as if this engine had computed it, and computes only
what follows its last full block (at least its last token, which it samples from). The prefix cache decides what
is used, so nothing here can make an output differ: a block taken for other contents before the request starts is
computed again.

Both engines must be the same model, block size, dtype and KV layout (the serve deployment's `prefill` replicas run
the deployment's own engine spec); `layout` says what the bytes mean, and an engine refuses a transfer whose layout
is not its own (`TransferRefused`, naming what differs) rather than read it. A model with recurrent layers keeps
states no block holds, so it is not disaggregated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pylon.errors import PylonError

log = logging.getLogger(__name__)


class TransferRefused(PylonError):
    """A transfer an engine cannot take in (its layout is not this engine's)."""


@dataclass
class KVTransfer:
    """A prompt's blocks from one engine for another (see the module's docs)."""

    layout: dict  # what the bytes are: block_size, groups, each runner's tensors' shapes and dtypes (`engine_layout`)
    names: list[bytes]  # each block's name in the prefix cache (its hash; a group's with the group's index appended)
    data: list = field(default_factory=list)  # each runner's each tensor's blocks, `ModelRunner.read_blocks`'s arrays
    prompt_tokens: int = 0  # the prompt's length, as the prefill engine read it
    cached_tokens: int = 0  # of which its own prefix cache held (not computed there)
    first_block: int = 0  # the position of the first block sent (the ones before, the asker said it holds)

    @property
    def num_blocks(self) -> int:
        return len(self.names)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.data)


def engine_layout(pool, runners: list) -> dict:
    """What a block of this engine is: its size in tokens, its groups' windows (HybridKVBlockPool), and each runner's
    (the model's, its drafting layer's) tensors, in order."""
    return {
        "block_size": pool.block_size,
        "groups": [w if w is None else str(w) for w in getattr(pool, "windows", [None])],
        "tensors": [[[list(shape), dtype] for shape, dtype in runner.kv_layout()] for runner in runners],
    }


def differences(theirs: dict, ours: dict) -> list[str]:
    """What differs between two engines' layouts, in words ([] where none)."""
    said = []
    for key, what in (("block_size", "engine.block_size"), ("groups", "the layers' groups (windows)")):
        if theirs.get(key) != ours.get(key):
            said.append(f"{what}: {theirs.get(key)} there, {ours.get(key)} here")
    if theirs.get("tensors") != ours.get("tensors") and not said:
        a, b = theirs.get("tensors") or [], ours.get("tensors") or []
        if len(a) != len(b):
            said.append(f"{len(a)} runner(s) there (a drafting layer's?), {len(b)} here")
        else:
            for r, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
                    there, here = (_tensor(t[first]) if first < len(t) else "none" for t in (x, y))
                    said.append(
                        f"runner {r}'s KV tensor {first}: {there} there, {here} here ({len(x)} tensors there, "
                        f"{len(y)} here; engine.dtype, engine.kv_cache_dtype, engine.tensor_parallel or the model)"
                    )
                    break
    return said


def _tensor(entry) -> str:
    shape, dtype = entry
    return f"{dtype} {list(shape)}"


def export_blocks(
    pool, runners: list, layout: dict, hashes: list[bytes], first_block: int, prompt_tokens: int, cached: int
) -> KVTransfer | None:
    """The blocks of a finished prompt (`hashes`: its full blocks' usable as a prefix), from `first_block` on: the
    longest prefix whose every block is still on the device, read from each runner (`layout`: this engine's,
    `engine_layout`). None where none is."""
    k = len(hashes)
    while k > first_block:
        named = pool.prefix_names(hashes[:k])
        blocks = pool.lookup([n for _, n in named])  # (the device's blocks of them, as far as each has one)
        if len(blocks) == len(named):
            break
        k -= 1
    if k <= first_block:
        return None
    sent = [(n, b) for (i, n), b in zip(named, blocks) if i >= first_block]
    if not sent:
        return None
    ids = [b for _, b in sent]
    data = [a for runner in runners for a in runner.read_blocks(ids)]
    return KVTransfer(
        layout,
        [n for n, _ in sent],
        data,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        first_block=first_block,
    )


def import_blocks(pool, runners: list, layout: dict, transfer: KVTransfer, copy_out=None) -> int:
    """Take `transfer`'s blocks into this engine's cache (those it lacks), before the next pass; how many. Raises
    TransferRefused where the transfer's layout is not this engine's (`layout`, `engine_layout`). `copy_out`: makes the
    pool's queued copies (a block taken whose cached contents go to the host tier first) before the blocks are
    written over."""
    said = differences(transfer.layout, layout)
    if said:
        raise TransferRefused("the prefill engine's KV blocks are not this engine's: " + "; ".join(said))
    taken = pool.adopt(transfer.names)
    if not taken:
        return 0
    if copy_out is not None:
        copy_out()
    rows = [i for i, _ in taken]
    ids = [b for _, b in taken]
    at = 0
    for runner, tensors in zip(runners, layout["tensors"]):
        n = len(tensors)
        arrays = transfer.data[at : at + n]
        at += n
        if len(rows) < transfer.num_blocks:
            arrays = [a[:, rows] for a in arrays]
        runner.write_blocks(ids, arrays)
    return len(taken)
