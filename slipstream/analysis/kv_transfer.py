"""Prefill/decode disaggregation: the cost of moving a prompt's KV cache.

A prefill instance hands a finished prompt to a decode instance by sending its
KV cache: every layer's K and V of every prompt token,

    bytes = prompt_tokens x layers x kv_elements_per_token x kv bytes per element

(for Llama-3-8B in bf16: 32 layers x 2 x 8 KV heads x 128 x 2 bytes = 128 KiB a
token, 512 MiB for a 4k-token prompt), over a point-to-point link in

    time = latency + bytes / bandwidth.

The split pays when that time is small against what the prefill itself costs
(its roofline time here): the decode instance then never stalls its batch on a
long prompt, and the prefill instance runs compute-bound prompt batches only.
slipstream moves the prompt's full blocks but the last token's (the decode
side computes that one to sample), so `tokens` is what moves, not the prompt.

With both instances tensor-parallel over `tp` ranks, rank r sends its own KV
heads' shard to rank r of the other instance, the `tp` pairs at once, each over
its own link: the time is one shard's, and the bytes are every shard's (KV
heads replicated on several ranks move once per rank). The prefill it is set
against is then the tensor-parallel step's compute (communication ignored).
"""
from __future__ import annotations

from dataclasses import dataclass

from slipstream.analysis.flops import Precisions, Workload
from slipstream.analysis.hardware import HardwareProfile
from slipstream.analysis.model_spec import ModelSpec
from slipstream.analysis.roofline import step_bound
from slipstream.analysis.tensor_parallel import Interconnect, pick_link

# Point-to-point links. `bus_bandwidth` here is the send/recv bandwidth of one
# large transfer; `latency` the floor of one call.
P2P_LINKS: dict[str, Interconnect] = {
    # The project's tensor-parallel issue: send/recv of 256 MiB between the two
    # H200s of nvidia-h200-x2 at 356 GB/s (NCCL 2.28, NVLink multicast off); the
    # per-call floor is taken from its small eager all-reduce (27.7 us).
    "h200-nvlink-p2p": Interconnect("2x H200 NVLink, NCCL send/recv", 356e9, 27.7e-6,
                                    "measured on nvidia-h200-x2 (NCCL 2.28)"),
    # Nominal figures (not measured here): one direction of the link.
    "pcie5-x16": Interconnect("PCIe 5.0 x16 (nominal)", 64e9, 10e-6, "nominal"),
    "ib-ndr-400": Interconnect("InfiniBand NDR 400 Gb/s (nominal)", 50e9, 5e-6, "nominal"),
    "ethernet-100g": Interconnect("100 Gb Ethernet (nominal)", 12.5e9, 20e-6, "nominal"),
}


def get_p2p_link(name: str | None = None, bandwidth: float | None = None,
                 latency: float | None = None) -> Interconnect:
    """A preset of P2P_LINKS (point-to-point transfers), or a custom link."""
    return pick_link(P2P_LINKS, "h200-nvlink-p2p", name, bandwidth, latency)


def kv_bytes_per_token(spec: ModelSpec, prec: Precisions = Precisions()) -> float:
    """KV cache bytes of one token over all layers."""
    return spec.num_layers * spec.kv_elements_per_token * prec.kv.bytes_per_element


def moved_tokens(prompt_tokens: int, block_size: int) -> int:
    """Tokens whose K/V slipstream moves: the full blocks before the last token's."""
    if prompt_tokens < 1 or block_size < 1:
        raise ValueError("prompt_tokens and block_size must be at least 1")
    return (prompt_tokens - 1) // block_size * block_size


@dataclass(frozen=True)
class KVTransferCost:
    tokens: int
    bytes_per_token: float
    bytes: float           # every rank pair's shard
    time: float            # seconds over the links (the pairs in parallel)
    prefill_time: float    # roofline time of computing the whole prompt (on tp devices)
    tp: int = 1

    @property
    def share_of_prefill(self) -> float:
        return self.time / self.prefill_time if self.prefill_time else float("inf")


def kv_transfer_time(nbytes: float, link: Interconnect) -> float:
    return link.latency + nbytes / link.bus_bandwidth


def kv_transfer_cost(spec: ModelSpec, hw: HardwareProfile, link: Interconnect, tokens: int,
                     prec: Precisions = Precisions(), compute_dtype: str = "bf16",
                     tp: int = 1) -> KVTransferCost:
    """Moving `tokens` tokens' KV over `link` (one a rank pair under tensor
    parallelism of size `tp`), against prefilling them on `tp` devices like `hw`."""
    if tokens < 1:
        raise ValueError(f"tokens must be at least 1, got {tokens}")
    if tp < 1:
        raise ValueError(f"tensor-parallel size must be at least 1, got {tp}")
    per_token = kv_bytes_per_token(spec, prec)
    shard = per_token * max(1, spec.num_kv_heads // tp) / spec.num_kv_heads   # one rank's
    prefill = step_bound(spec, hw.times(tp), Workload.prefill(tokens), prec,
                         compute_dtype).whole.time
    return KVTransferCost(tokens, per_token, shard * tokens * tp,
                          kv_transfer_time(shard * tokens, link), prefill, tp)


def render_kv_transfer(spec: ModelSpec, hw: HardwareProfile, link: Interconnect,
                       costs: list[KVTransferCost]) -> str:
    tp = costs[0].tp if costs else 1
    pairs = f"{tp} rank pairs, each " if tp > 1 else ""
    lines = [f"{spec.name}: KV cache handed from a prefill to a decode instance over "
             f"{pairs}{link.name} [{link.bus_bandwidth / 1e9:g} GB/s, {link.latency * 1e6:g} us; "
             f"{link.source}]; prefill roofline on {f'{tp} x ' if tp > 1 else ''}{hw.name}",
             f"{'tokens':>7} {'KiB/token':>9} {'MiB moved':>9} {'transfer':>10} "
             f"{'prefill':>10} {'transfer/prefill':>16}"]
    for c in costs:
        lines.append(f"{c.tokens:>7} {c.bytes_per_token / 1024:>9.1f} {c.bytes / 2**20:>9.1f} "
                     f"{c.time * 1e3:>8.3f}ms {c.prefill_time * 1e3:>8.3f}ms "
                     f"{c.share_of_prefill * 100:>15.1f}%")
    return "\n".join(lines)
