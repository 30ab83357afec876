"""A pull in flight: the rows of one table a worker asked the servers for, by step, and the
broadcasts that bring them; requested before they are needed, waited for when used."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from autoshard.runtime.ps.job import Job

__all__ = ["Pull", "request"]


@dataclass
class Pull:
    """The rows ``unique`` (sorted) of table ``path`` for step ``step``: ``slices`` holds
    (server, a, b) for each server that sends ``unique[a:b]``, ``parts`` the buffers its
    rows land in, ``works`` the broadcasts to wait for."""

    path: str
    step: int
    unique: torch.Tensor
    slices: list[tuple[int, int, int]] = field(default_factory=list)
    parts: list[torch.Tensor] = field(default_factory=list)
    works: list[tuple[int, object]] = field(default_factory=list)  # (server, broadcast)
    ids: list[torch.Tensor] = field(default_factory=list)  # sent: kept until sent

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)

    def rows(self, job: Job, dim: int, dtype: torch.dtype) -> torch.Tensor:
        """The rows, once every broadcast of them is done."""
        while self.works:
            server, work = self.works.pop(0)
            with job.talking_to(server, f"pull of step {self.step}"):
                work.wait()
        self.ids.clear()
        if not self.parts:
            return torch.empty(0, dim, dtype=dtype, device=job.device)
        return torch.cat(self.parts)


def request(
    job: Job,
    path: str,
    step: int,
    unique: torch.Tensor,
    ranges: list[tuple[int, int]],
    dim: int,
    dtype: torch.dtype,
) -> Pull:
    """Ask each server holding some of ``unique`` for them (every server hears of the pull,
    rows or none, so that it checks its staleness) and start their broadcasts: a server
    answers its queue in order, so it meets each broadcast as it comes to the request."""
    pull = Pull(path, step, unique)
    bounds = torch.tensor([b for r in ranges for b in r], device=unique.device)
    cuts = torch.searchsorted(unique, bounds).tolist()
    for i, s in enumerate(job.servers):
        lo, (a, b) = ranges[i][0], cuts[2 * i : 2 * i + 2]
        job.post(s, f"pull {job.rank} {step} {path} {b - a}")
        if b == a:
            continue
        pull.slices.append((s, a, b))
        ids = (unique[a:b] - lo).contiguous()
        rows = torch.empty(b - a, dim, dtype=dtype, device=job.device)
        pull.ids.append(ids)
        pull.parts.append(rows)
        with job.talking_to(s, f"pull of step {step}"):
            pull.works += [
                (s, job.cast_async(ids, job.rank, s)),
                (s, job.cast_async(rows, s, s)),
            ]
    return pull
