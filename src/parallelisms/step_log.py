"""Each step's loss, kept for the report without one tensor object per step: a long run's rank memory then
grows by 8 bytes a step, not by a tensor's bookkeeping (about half a kilobyte). The losses stay on the device
(stacking them does not wait for it) and are stacked in blocks as the run goes."""

from __future__ import annotations

import torch


class LossLog:
    """``append`` each step's scalar loss tensor; ``stacked()`` gives them all as one tensor."""

    BLOCK = 512  # losses held as separate tensors before they are stacked into one

    def __init__(self):
        self.blocks: list[torch.Tensor] = []
        self.pending: list[torch.Tensor] = []

    def append(self, loss: torch.Tensor) -> None:
        self.pending.append(loss.detach())
        if len(self.pending) == self.BLOCK:
            self.blocks.append(torch.stack(self.pending))
            self.pending = []

    def __len__(self) -> int:
        return sum(len(b) for b in self.blocks) + len(self.pending)

    def stacked(self) -> torch.Tensor:
        return torch.cat([*self.blocks, *([torch.stack(self.pending)] if self.pending else [])])
