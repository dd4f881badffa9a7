"""Shared-memory and register budget of the three Pallas (Triton) kernels, computed on the host.

Triton compiles the lowered kernels to PTX only on a GPU, so a tile choice that needs more shared
memory than a block may have (H100/H200: 227 KiB = 232,448 bytes, the opt-in maximum), or more
registers than a thread may have (255: beyond that the compiler spills to local memory), would
otherwise fail (or crawl) only there. This module counts what each kernel holds per program:

* **streamed** tiles: what one iteration of a kernel's ``fori_loop`` loads; Triton's software
  pipeliner keeps ``num_stages`` copies of each in shared memory;
* **resident** tiles: loaded once per program and used by every iteration (the forward's q tile,
  dq's q/do tiles, dk/dv's K/V tiles); a tensor-core operand passes through shared memory, once;
* **scratch**: one ``[bq, bk]`` tile per dot whose operand is computed inside the loop (p, ds) and
  needs a layout change (a transpose for dk/dv's ``p^T do`` and ``ds^T q``);
* **registers**: fp32 accumulators, the resident operands and the fp32 ``[bq, bk]`` score tiles
  a loop iteration keeps live, spread over ``32 * num_warps`` threads, plus a fixed allowance for
  addresses, indices and loop state.

dk/dv sums over the G query heads of its kv head. ``dkdv_groups="unroll"`` (the first version)
loads the G heads' q/do tiles in one loop body, so the pipeliner streams ``2G`` tiles per stage;
``"loop"`` walks (query tile, head) pairs in one loop and streams 2. The model is a deliberate
upper bound of what Triton allocates (it may reuse scratch); ``scripts/gpu_check.sh`` compiles the
kernels on a GPU and records what really fits.
"""

from __future__ import annotations

import dataclasses

# H100 / H200 (sm_90): the most shared memory one block may opt into, and registers per thread.
SHARED_MEMORY_BYTES = 232_448
REGISTERS_PER_THREAD = 255
# Addresses, loop counters, mask vectors, softmax statistics: a fixed per-thread allowance.
REGISTER_OVERHEAD = 32
KERNELS = ("forward", "dq", "dkdv")


@dataclasses.dataclass(frozen=True)
class KernelBudget:
    """What one kernel holds per program, in bytes of shared memory and 32-bit registers/thread."""

    kernel: str
    streamed_bytes: int  # per pipeline stage
    stages: int
    resident_bytes: int
    scratch_bytes: int
    registers_per_thread: int

    @property
    def shared_bytes(self) -> int:
        return self.stages * self.streamed_bytes + self.resident_bytes + self.scratch_bytes

    def problems(self, shared_limit: int = SHARED_MEMORY_BYTES) -> list[str]:
        out = []
        if self.shared_bytes > shared_limit:
            out.append(
                f"{self.shared_bytes:,} bytes of shared memory ({self.stages} stages x "
                f"{self.streamed_bytes:,} streamed + {self.resident_bytes:,} resident + "
                f"{self.scratch_bytes:,} scratch) > {shared_limit:,}"
            )
        if self.registers_per_thread > REGISTERS_PER_THREAD:
            out.append(
                f"~{self.registers_per_thread} registers per thread > {REGISTERS_PER_THREAD} "
                "(spills): use more warps or smaller tiles"
            )
        return out


def _registers(fp32_values: int, operand_bytes: int, num_warps: int) -> int:
    threads = 32 * num_warps
    return -(-(fp32_values + operand_bytes // 4) // threads) + REGISTER_OVERHEAD


def estimate(tiles, head_dim: int, groups: int, itemsize: int) -> dict[str, KernelBudget]:
    """Per-kernel budget for ``tiles`` (``pallas_triton.TileConfig``), ``groups`` = query heads per kv
    head (G), ``itemsize`` of q/k/v (2 for bf16)."""
    H, t = head_dim, tiles
    i32 = 4
    bq, bk = t.block_q, t.block_k
    fwd = KernelBudget(
        "forward",
        streamed_bytes=2 * bk * H * itemsize + 2 * bk * i32,  # k, v tiles + context seg/pos
        stages=t.num_stages,
        resident_bytes=bq * H * itemsize + 3 * bq * i32,  # q tile + per-query mask arrays
        scratch_bytes=bq * bk * itemsize,  # p as the left operand of p @ v
        # acc [bq, H], s and p [bq, bk] in fp32; the q operand
        registers_per_thread=_registers(bq * H + 2 * bq * bk, bq * H * itemsize, t.num_warps),
    )
    bq, bk = t.block_q_bwd, t.block_k_bwd
    dq = KernelBudget(
        "dq",
        streamed_bytes=2 * bk * H * itemsize + 2 * bk * i32,
        stages=t.num_stages_bwd,
        resident_bytes=2 * bq * H * itemsize + 5 * bq * i32,  # q, do + lse, delta, mask arrays
        scratch_bytes=bq * bk * itemsize,  # ds as the left operand of ds @ k
        registers_per_thread=_registers(bq * H + 2 * bq * bk, 2 * bq * H * itemsize, t.num_warps_bwd),
    )
    heads_per_step = groups if t.dkdv_groups == "unroll" else 1
    dkdv = KernelBudget(
        "dkdv",
        # per head: q, do tiles and their lse, delta rows; once: the per-query mask arrays
        streamed_bytes=heads_per_step * (2 * bq * H * itemsize + 2 * bq * i32) + 3 * bq * i32,
        stages=t.num_stages_dkdv,
        resident_bytes=2 * bk * H * itemsize + 2 * bk * i32,  # K, V tiles + context seg/pos
        scratch_bytes=2 * bq * bk * itemsize,  # p^T and ds^T
        # dk, dv accumulators [bk, H] fp32; p, ds [bq, bk] fp32; the K/V operands
        registers_per_thread=_registers(2 * bk * H + 2 * bq * bk, 2 * bk * H * itemsize, t.num_warps_dkdv),
    )
    return {"forward": fwd, "dq": dq, "dkdv": dkdv}


def problems(tiles, head_dim: int, groups: int, itemsize: int, kernels=KERNELS) -> dict[str, list[str]]:
    """{kernel: [what is over budget]} for the kernels in ``kernels``; empty lists where it fits."""
    est = estimate(tiles, head_dim, groups, itemsize)
    return {k: est[k].problems() for k in kernels}


def check(tiles, head_dim: int, groups: int, itemsize: int) -> None:
    """Raise ValueError naming each kernel over budget, and why."""
    bad = {k: p for k, p in problems(tiles, head_dim, groups, itemsize).items() if p}
    if bad:
        detail = "; ".join(f"the {k} kernel needs {' and '.join(p)}" for k, p in bad.items())
        raise ValueError(
            f"tile config {tiles} does not fit one H100/H200 block at head_dim={head_dim}, G={groups}, "
            f"itemsize={itemsize}: {detail}"
        )
