"""The collective exchanges of sequence parallelism behind one small interface.

`seq_to_heads` / `heads_to_seq` are the two Ulysses all_to_all steps (DeepSpeed-Ulysses, Jacobs et al. 2023,
arXiv:2309.14509): a rank holding `[B, T/W, H, D]` (its token slice, all heads) ends up with `[B, T, H/W, D]` (all
tokens, its head slice) and back. The default is `torch.distributed.all_to_all_single`; a faster kernel from
the repository's `kernels/` folder (loaded from its file under a private module name; that folder is not a
package, see its README) can replace `Exchange` without touching the model code.

The collectives are registered as PyTorch custom ops (`ltx2_mgpu::all_to_all`, `ltx2_mgpu::all_gather`, with fake
implementations for shapes), so a transformer block compiled with `torch.compile` keeps them inside its graph
instead of breaking it in two around every exchange (`mgpu_backend/engine/compile.py`). Custom ops cannot take a process
group argument: an `Exchange` registers its group under an integer key.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from ..engine import cuda_graphs

_GROUPS: dict[int, dist.ProcessGroup | None] = {}  # key -> process group (None: the default group)
_KEYS = itertools.count()


@torch.library.custom_op("ltx2_mgpu::all_to_all", mutates_args=())
def all_to_all(send: torch.Tensor, group_key: int) -> torch.Tensor:
    """`torch.distributed.all_to_all_single` of a contiguous `[W, ...]` tensor: block j goes to rank j, block j of
    the result came from rank j."""
    group = _GROUPS[group_key]
    # a segment boundary while a CUDA graph is being captured (`cuda_graphs.collective`), else just the collective
    return cuda_graphs.collective(lambda out, inp: dist.all_to_all_single(out, inp, group=group), send.contiguous(),
                                  torch.empty_like(send))


@all_to_all.register_fake
def _(send, group_key):
    return torch.empty_like(send)


@torch.library.custom_op("ltx2_mgpu::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, group_key: int, world_size: int) -> torch.Tensor:
    """Every rank's `x` stacked in rank order: `[W, *x.shape]`."""
    group = _GROUPS[group_key]
    nccl = dist.get_backend(group) == "nccl"

    def gather(out: torch.Tensor, inp: torch.Tensor) -> None:
        if nccl:
            dist.all_gather_into_tensor(out.view(world_size * inp.shape[0], *inp.shape[1:]), inp, group=group)
        else:  # gloo: the list form is the one it implements for CPU and CUDA tensors alike
            dist.all_gather(list(out.unbind(0)), inp, group=group)

    return cuda_graphs.collective(gather, x.contiguous(), x.new_empty((world_size, *x.shape)))


@all_gather.register_fake
def _(x, group_key, world_size):
    return x.new_empty((world_size, *x.shape))


class Exchange:
    """all_to_all / all_gather over one process group (NCCL on CUDA, gloo on CPU)."""

    def __init__(self, group: dist.ProcessGroup | None, world_size: int, rank: int):
        self.group, self.world_size, self.rank = group, world_size, rank
        self.group_key = next(_KEYS)
        _GROUPS[self.group_key] = group

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, T/W, H, D]` (this rank's tokens, all heads) -> `[B, T, H/W, D]` (all tokens, this rank's heads).

        Raises ValueError when H is not divisible by W.
        """
        w = self.world_size
        if w == 1:
            return x
        b, t_local, h, d = x.shape
        if h % w:
            raise ValueError(f"{h} heads cannot be split over {w} ranks (the SP degree must divide the heads)")
        # send block j = head slice j of my tokens: [W, B, T/W, H/W, D]
        send = x.reshape(b, t_local, w, h // w, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = all_to_all(send, self.group_key)
        # recv block j = my head slice of rank j's tokens -> tokens in rank order
        return recv.permute(1, 0, 2, 3, 4).reshape(b, w * t_local, h // w, d)

    def heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """Inverse of `seq_to_heads`: `[B, T, H/W, D]` -> `[B, T/W, H, D]`."""
        w = self.world_size
        if w == 1:
            return x
        b, t, h_local, d = x.shape
        send = x.reshape(b, w, t // w, h_local, d).permute(1, 0, 2, 3, 4).contiguous()
        recv = all_to_all(send, self.group_key)
        # recv block j = rank j's head slice of my tokens -> heads in rank order
        return recv.permute(1, 2, 0, 3, 4).reshape(b, t // w, w * h_local, d)

    def all_gather_seq(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Concatenate every rank's slice along `dim` in rank order."""
        if self.world_size == 1:
            return x
        parts = all_gather(x, self.group_key, self.world_size)  # [W, *x.shape]
        return torch.cat(parts.unbind(0), dim=dim)
