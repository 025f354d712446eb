"""Training loader over a feature store: contiguous block reads, two-level shuffle.

Random per-sample reads are slow on chunked storage (a chunk is decoded to get one
sample), so the loader reads whole blocks (``block_size`` consecutive samples, by default
one Zarr chunk) and shuffles at two levels, as WebDataset does with shards:

1. the order of blocks, by a permutation seeded by ``(seed, epoch)``, identical on every
   rank and worker, which then take disjoint slices of it;
2. samples within a buffer of ``buffer_size`` samples, seeded by ``(seed, epoch, rank,
   worker)``.

Under DDP the ranks read disjoint blocks and every rank yields the same number of
batches (each stops at the count of the smallest rank; the few samples left over differ
from epoch to epoch), so no rank waits forever in a collective.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from features.store import Store


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def pad_stack(values: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Arrays of different lengths along axis 0 -> ``(B, L_max, ...)`` zero-padded + lengths."""
    lengths = np.array([len(v) for v in values], dtype=np.int64)
    padded = np.zeros(
        (len(values), max(int(lengths.max(initial=0)), 1), *values[0].shape[1:]),
        dtype=values[0].dtype,
    )
    for i, v in enumerate(values):
        padded[i, : len(v)] = v
    return torch.from_numpy(padded), torch.from_numpy(lengths)


def collate(samples: dict[str, list], index: np.ndarray, ragged: set[str]) -> dict:
    """Dense fields stack to ``(B, ...)``; ragged ones pad to ``(B, L_max, ...)`` + lengths."""
    batch: dict[str, torch.Tensor] = {"index": torch.from_numpy(index)}
    for name, values in samples.items():
        if name in ragged:
            batch[name], batch[f"{name}_lengths"] = pad_stack(values)
        else:
            batch[name] = torch.from_numpy(np.ascontiguousarray(values))
    return batch


class BlockShuffleLoader(IterableDataset):
    """Batches of ``fields`` from the store at ``url``; use with ``DataLoader(batch_size=None)``.

    ``indices`` selects the samples (e.g. one split), in store order; call
    :meth:`set_epoch` before each epoch. ``rank``/``world_size`` default to the
    initialised ``torch.distributed`` group.
    """

    def __init__(
        self,
        url: str,
        fields: Sequence[str],
        batch_size: int,
        *,
        indices: Sequence[int] | None = None,
        block_size: int | None = None,
        buffer_size: int = 4096,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = True,
        storage_options: dict | None = None,
    ):
        self.url = str(url)
        self.fields = list(fields)
        self.batch_size = batch_size
        self.buffer_size = max(buffer_size, batch_size)
        self.seed = seed
        self.drop_last = drop_last
        self.storage_options = storage_options
        self.epoch = 0
        store = self.store
        n = len(store)
        self.indices = np.arange(n) if indices is None else np.sort(np.asarray(indices))
        self.block_size = block_size or store.samples_per_chunk
        dist_rank, dist_world = _dist_rank_world()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        self.ragged = {name for name in self.fields if store.fields[name].ragged}

    @property
    def store(self) -> Store:
        """Opened lazily, once per process (DataLoader workers reopen it)."""
        if getattr(self, "_store", None) is None:
            self._store = Store.open(self.url, storage_options=self.storage_options)
        return self._store

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_store"] = None
        return state

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _blocks(self) -> list[np.ndarray]:
        return [
            self.indices[i : i + self.block_size]
            for i in range(0, len(self.indices), self.block_size)
        ]

    def _plan(self, n_workers: int) -> tuple[list[list[np.ndarray]], np.ndarray]:
        """Blocks of every (rank, worker) slot for this epoch, and each slot's batch quota."""
        blocks = self._blocks()
        slots = self.world_size * n_workers
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(blocks))
        assigned = [[blocks[b] for b in order[s::slots]] for s in range(slots)]
        samples = np.array([sum(len(b) for b in slot) for slot in assigned])
        if self.drop_last:
            quota = samples // self.batch_size
        else:
            quota = -(-samples // self.batch_size)
        if self.world_size > 1:  # equal batch counts on every rank, worker by worker
            quota = np.tile(quota.reshape(self.world_size, n_workers).min(0), self.world_size)
        return assigned, quota

    def __len__(self) -> int:
        """Batches this rank yields per epoch (over all its DataLoader workers)."""
        _, quota = self._plan(1)
        return int(quota[self.rank])

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, n_workers = (info.id, info.num_workers) if info else (0, 1)
        slot = self.rank * n_workers + worker
        assigned, quota = self._plan(n_workers)
        rng = np.random.default_rng([self.seed, self.epoch, self.rank, worker])
        emitted = 0
        for batch in self._batches(assigned[slot], rng):
            if emitted == quota[slot]:
                return
            yield batch
            emitted += 1

    def _batches(self, blocks: list[np.ndarray], rng: np.random.Generator) -> Iterator[dict]:
        """Fill a buffer with whole blocks, shuffle it, emit batches, carry the remainder.

        The buffer holds blocks as they were read (for a local uncompressed store, views
        of the mapped shard files) plus ``refs``, one ``(block, row)`` pair per sample; a
        batch is gathered from them in one copy, as a memmap fancy-index would be.
        """
        store, bs = self.store, self.batch_size
        held: list[tuple[dict, np.ndarray]] = []  # (fields of a block, sample indices)
        refs = np.empty((0, 2), dtype=np.int64)
        for k, block in enumerate(blocks):
            lo, hi = int(block[0]), int(block[-1]) + 1
            data = store.read(lo, hi, self.fields, copy=False)  # one contiguous read
            rows = block - lo
            refs = np.concatenate([refs, np.stack([np.full(len(rows), len(held)), rows], 1)])
            held.append((data, np.arange(lo, hi)))
            last = k == len(blocks) - 1
            if len(refs) < self.buffer_size and not last:
                continue
            # at this point the buffer holds >= buffer_size samples (or the epoch's last ones)
            refs = refs[rng.permutation(len(refs))]
            n_full = len(refs) // bs * bs
            for start in range(0, len(refs) if last else n_full, bs):
                chosen = refs[start : start + bs]
                if len(chosen) < bs and self.drop_last:
                    break
                yield collate(*self._gather(held, chosen), self.ragged)
            # fewer than a batch left: copy them out, so the blocks can be released
            carry = refs[n_full:]
            held = [self._gather(held, carry)]
            refs = np.stack([np.zeros(len(carry), np.int64), np.arange(len(carry))], 1)

    def _gather(self, held, refs: np.ndarray) -> tuple[dict, np.ndarray]:
        """Samples ``refs`` (block, row) of the held blocks, copied into fresh arrays, and
        their store indices. Rows are taken block by block (a batch is a random set; its
        order inside does not matter), one fancy-indexed copy per block."""
        refs = refs[np.lexsort((refs[:, 1], refs[:, 0]))]
        blocks, starts, counts = np.unique(refs[:, 0], return_index=True, return_counts=True)
        spans = list(zip(blocks, starts, starts + counts, strict=True))
        out: dict = {}
        for name in self.fields:
            if name in self.ragged:
                out[name] = [held[b][0][name][r] for b, r in refs]
                continue
            first = held[0][0][name]
            array = np.empty((len(refs), *first.shape[1:]), dtype=first.dtype)
            for b, lo, hi in spans:  # one copy, straight into the batch
                # mode="clip": rows are valid by construction, and "raise" buffers the copy
                np.take(held[b][0][name], refs[lo:hi, 1], axis=0, out=array[lo:hi], mode="clip")
            out[name] = array
        index = [held[b][1][refs[lo:hi, 1]] for b, lo, hi in spans]
        return out, np.concatenate(index or [np.empty(0)]).astype(np.int64)
