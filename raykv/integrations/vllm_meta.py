"""What the vLLM connector's scheduler side sends its workers each engine step: the loads
and saves of the step (vLLM pickles the metadata to every worker)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(slots=True)
class LoadSpec:
    """Copy tokens [start, end) of a request from raykv into its blocks.

    `hashes` are vLLM's block hashes at the ends of the whole chunks holding them (chunk i
    ends at token (i + 1) * chunk_size), `block_ids` the request's blocks from token 0.
    `sync`: copy before this step's forward pass (else on the loader thread)."""

    req_id: str
    lookup_id: str
    hashes: list[bytes]
    start: int
    end: int
    block_ids: list[int]
    sync: bool


@dataclass(slots=True)
class SaveSpec:
    """Store the whole chunks of tokens [start, end) of a request (both chunk-aligned);
    `hashes` key every chunk of [0, end)."""

    req_id: str
    hashes: list[bytes]
    start: int
    end: int
    block_ids: list[int]


@dataclass
class RayKVConnectorMetadata(KVConnectorMetadata):
    """What the workers load and save in one engine step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


__all__ = ["LoadSpec", "RayKVConnectorMetadata", "SaveSpec"]
