"""The accelerator catalog the planner prices and sizes jobs with: `accelerators.yaml`, shipped with the package.

    catalog = load_catalog()                         # prices from $PYLON_GPU_PRICES if it names a file
    catalog = load_catalog(prices="prices.yaml")     # or from this file: {H100-SXM: 2.49, A100-80GB: 1.2}
    h100 = catalog.get("h100")                       # names and aliases, any case; unknown names list the known

Every figure is a datasheet number (sources in the YAML's comments); prices are typical on-demand list prices,
checked 2026, and are the part a user should override.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path

import yaml

from pylon import settings
from pylon.errors import PylonError

PRICES_ENV = settings.GPU_PRICES
_CATALOG_FILE = "accelerators.yaml"
GIB = 2**30


@dataclass(frozen=True)
class Accelerator:
    name: str
    vendor: str
    memory_gib: float
    bandwidth_gbs: float  # device memory, GB/s
    bf16_tflops: float  # dense, FP32 accumulate
    fp32_tflops: float
    interconnect: str
    interconnect_gbs: float  # GPU-to-GPU inside a node, per GPU, one direction
    network: str  # the network between nodes (NICs per node x their rate)
    node_network_gbs: float  # between nodes, the node's NICs together, one direction
    gpus_per_node: int
    host_memory_gib: float  # per node
    nvme_tb: float  # per node
    price_per_gpu_hour: float  # USD
    host_link_gbs: float = 25.0  # GPU <-> host memory (PCIe), one direction: what offloading moves through
    aliases: tuple[str, ...] = field(default=())

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def host_memory_bytes(self) -> int:
        return int(self.host_memory_gib * GIB)

    @property
    def nvme_bytes(self) -> int:
        return int(self.nvme_tb * 1e12)

    def peak_flops(self, precision: str) -> float:
        """Dense matmul FLOP/s in a training precision (fp32 runs on the FP32 units: TF32 is off by default)."""
        return (self.fp32_tflops if precision == "fp32" else self.bf16_tflops) * 1e12


@dataclass(frozen=True)
class Catalog:
    accelerators: tuple[Accelerator, ...]
    prices_source: str  # where the prices came from, for the plan's notes
    vcpu_price_per_hour: float = 0.0  # USD per vCPU-hour (what a run's ledger charges for CPU workers)
    egress_price_per_gb: float = 0.0  # USD per GB (1e9 bytes) read out of object storage

    def names(self) -> list[str]:
        return [a.name for a in self.accelerators]

    def get(self, name: str) -> Accelerator:
        """The accelerator called `name` (or one of its aliases), ignoring case, spaces, '-' and '_'."""
        wanted = _key(name)
        for acc in self.accelerators:
            if wanted in {_key(acc.name), *(_key(a) for a in acc.aliases)}:
                return acc
        raise PylonError(
            f"unknown GPU '{name}'; known: {', '.join(self.names())} (aliases such as H100, A100-80 and 4090 work too)"
        )


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", str(name)).lower()


def load_catalog(prices: str | os.PathLike | None = None) -> Catalog:
    """The shipped catalog, with prices from `prices` (a YAML file), else from the file $PYLON_GPU_PRICES names."""
    text = resources.files("pylon.plan").joinpath(_CATALOG_FILE).read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    catalog = Catalog(
        tuple(_accelerator(entry) for entry in data["accelerators"]),
        prices_source=f"typical on-demand list prices, 2026 (pylon/{_CATALOG_FILE})",
        vcpu_price_per_hour=float(data["other_prices"][VCPU]),
        egress_price_per_gb=float(data["other_prices"][EGRESS_GB]),
    )
    path = prices if prices is not None else settings.value(PRICES_ENV)
    if path is not None:
        catalog = with_prices(catalog, path, source=str(path) if prices is not None else f"${PRICES_ENV}={path}")
    return catalog


VCPU, EGRESS_GB = "vCPU", "egress_GB"  # the prices file's keys for the two prices that are not a GPU's


def _accelerator(entry: dict) -> Accelerator:
    entry = dict(entry)
    entry["aliases"] = tuple(entry.get("aliases") or ())
    return Accelerator(**entry)


def with_prices(catalog: Catalog, path: str | os.PathLike, *, source: str | None = None) -> Catalog:
    """`catalog` with the prices in the YAML file `path`: a mapping of accelerator name (or alias) to US dollars
    per GPU-hour, optionally under a top-level `prices:` key, and the keys `vCPU` (USD per vCPU-hour) and
    `egress_GB` (USD per GB out of object storage). Names not in the file keep their price."""
    where = source or str(path)
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PylonError(f"{where}: no such prices file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PylonError(f"{where}: cannot read the prices file: {e}") from None
    except yaml.YAMLError as e:
        raise PylonError(f"{where}: not valid YAML: {e}") from None
    if isinstance(data, dict) and set(data) == {"prices"}:
        data, prefix = data["prices"], "prices."
    else:
        prefix = ""
    if not isinstance(data, dict) or not data:
        raise PylonError(
            f"{where}: must be a mapping of GPU name to US dollars per GPU-hour, "
            f"e.g. 'H100-SXM: 2.49' (known GPUs: {', '.join(catalog.names())}; also vCPU and egress_GB)"
        )
    updated = {a.name: a for a in catalog.accelerators}
    other = {VCPU: catalog.vcpu_price_per_hour, EGRESS_GB: catalog.egress_price_per_gb}
    problems = []
    for name, price in data.items():
        key = next((k for k in other if _key(k) == _key(str(name))), None)
        if key is not None:
            if isinstance(price, bool) or not isinstance(price, (int, float)) or price < 0:
                unit = "per vCPU-hour" if key == VCPU else "per GB"
                problems.append(
                    f"{where}: {prefix}{name}: must be a non-negative number of US dollars {unit} (got {price!r})"
                )
            else:
                other[key] = float(price)
            continue
        try:
            acc = catalog.get(str(name))
        except PylonError as e:
            problems.append(f"{where}: {prefix}{name}: {e}")
            continue
        if isinstance(price, dict) and set(price) == {"price_per_gpu_hour"}:
            price = price["price_per_gpu_hour"]
        if isinstance(price, bool) or not isinstance(price, (int, float)) or price < 0:
            problems.append(
                f"{where}: {prefix}{name}: must be a non-negative number of US dollars per GPU-hour (got {price!r})"
            )
            continue
        updated[acc.name] = replace(acc, price_per_gpu_hour=float(price))
    if problems:
        raise PylonError("\n".join(problems))
    return Catalog(
        tuple(updated[a.name] for a in catalog.accelerators),
        prices_source=where,
        vcpu_price_per_hour=other[VCPU],
        egress_price_per_gb=other[EGRESS_GB],
    )
