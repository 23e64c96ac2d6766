"""Parallel degrees: one validated object shared by the trainer and the planner.

Four degrees make up the world: `dp_replicate` (DDP, or the replica dimension of HSDP),
`dp_shard` (FSDP2 sharding), `tp` (DTensor tensor parallelism) and `pp` (pipeline stages: the
planner models them; the trainer runs pp = 1). Their product must equal the world size; at most
one may be -1, meaning "whatever is left".
"""
from __future__ import annotations

from dataclasses import dataclass

from hardy.errors import HardyError

# How the data-parallel degrees are wrapped (`parallelize.wrapping`); the config checks against it too.
WRAPS = ("auto", "fsdp", "ddp")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    pp: int = 1

    @classmethod
    def build(cls, world_size: int, dp_replicate: int = -1, dp_shard: int = 1, tp: int = 1,
              pp: int = 1) -> "ParallelDims":
        if world_size < 1:
            raise HardyError(f"world size must be >= 1 (got {world_size})")
        degrees = {"dp_replicate": dp_replicate, "dp_shard": dp_shard, "tp": tp, "pp": pp}
        for name, value in degrees.items():
            if value == 0 or value < -1:
                raise HardyError(f"parallel.{name} must be a positive integer or -1 (got {value})")
        free = [name for name, value in degrees.items() if value == -1]
        if len(free) > 1:
            raise HardyError(f"only one parallel degree may be -1 (got {', '.join(free)})")
        fixed = 1
        for value in degrees.values():
            if value != -1:
                fixed *= value
        if free:
            if world_size % fixed:
                raise HardyError(f"parallel degrees {_fmt(degrees)} cannot fill a world of {world_size} processes: "
                                 f"{world_size} is not divisible by {fixed}")
            degrees[free[0]] = world_size // fixed
        product = degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"] * degrees["pp"]
        if product != world_size:
            raise HardyError(f"parallel degrees {_fmt(degrees)} multiply to {product}, but the world size is "
                             f"{world_size}")
        return cls(world_size=world_size, **degrees)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches are processed per step."""
        return self.dp_replicate * self.dp_shard

    @property
    def uses_fsdp(self) -> bool:
        return self.dp_shard > 1

    @property
    def uses_ddp(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard == 1

    @property
    def uses_tp(self) -> bool:
        return self.tp > 1

    def describe(self) -> str:
        parts = []
        if self.uses_fsdp:
            parts.append(f"HSDP {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"FSDP {self.dp_shard}")
        elif self.uses_ddp:
            parts.append(f"DDP {self.dp_replicate}")
        if self.uses_tp:
            parts.append(f"TP {self.tp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        return " + ".join(parts) or "single process"

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        return (self.dp_replicate, self.dp_shard, self.tp), ("dp_replicate", "dp_shard", "tp")

    def dp_rank(self, rank: int) -> int:
        """Data-parallel rank of a global rank (mesh order: replicate, shard, tp; tp fastest)."""
        return rank // self.tp


def _fmt(degrees: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in degrees.items())
