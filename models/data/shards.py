""":class:`ShardData`: the batches of training streamed from WebDataset shards built from the
stores, with the batch contract of :class:`models.data.pairs.PairData`."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from models.data.arrays import (
    _KeysAt,
    image_arrays,
    put,
    refuse_non_finite_inputs,
    scene_graph_batch,
    text_arrays,
)
from models.data.info import FLOAT_INPUTS, DataError, DataInfo
from models.data.pairs import PairData


class ShardData:
    """The training pairs of ``data`` (a :class:`PairData` of the train split: sizes,
    vocabulary, feature statistics) streamed from WebDataset shards (``url``: a folder or
    an fsspec URL such as ``s3://bucket/shards``) that ``vse shards build`` made from the
    same stores; they are checked against them (manifest digest, store fingerprints, scene
    graphs). Same batch contract as :class:`PairData` (:meth:`stream` yields raw "pair"
    batches, built by the same code from the shards' groups).

    Epoch ``e``: the train shards in an order seeded by ``(seed, e)`` are dealt to the
    ``world x workers`` streams; each stream shuffles captions in a buffer of
    ``shuffle_buffer`` captions (whole groups, seeded by ``(seed, e, rank, worker)``) and
    yields full batches; every rank takes the same number of steps (the smallest over
    ranks and epochs), so collectives never wait on a rank that ran out. A batch's rows
    are in storage order (its captions are a random set; the order within it is not).
    """

    def __init__(self, url: str, data: PairData, cfg, storage_options: dict | None = None):
        from features.scenegraph.files import GRAPHS
        from features.shards.reader import check_sources, read_sizes, shard_names
        from infra.files import sha256_file

        self.url, self.storage_options, self.data = str(url), storage_options, data
        sizes = read_sizes(self.url, storage_options)
        graphs = None
        if data.graphs is not None:
            graphs = sha256_file(Path(data.paths.scenegraphs) / GRAPHS)
        names = check_sources(self.url, sizes, data.manifest_digest, data.stores, graphs)
        self.names = names  # role ("regions", "text", ...) -> packed store name
        self.fields = {role: sizes["stores"][name]["fields"] for role, name in names.items()}
        self.shards = shard_names(sizes, "train")
        self.recorded = [sizes["shards"][n] for n in self.shards]  # members' CRC-32C
        if not self.shards:
            raise DataError(f"{self.url}: no train shards; rebuild with `vse shards build`")
        self.captions = np.array([sizes["shards"][n]["captions"] for n in self.shards])
        self.batch_size, self.seed, self.epochs = cfg.batch_size, cfg.seed, cfg.epochs
        self.buffer = max(cfg.shuffle_buffer, cfg.batch_size)
        self.workers = max(1, cfg.num_workers)

    # the sizes and statistics are the stores'
    @property
    def info(self) -> DataInfo:
        return self.data.info

    @property
    def stats(self) -> dict:
        return self.data.stats

    def feature_stats(self, max_images: int = 5000) -> dict:
        return self.data.feature_stats(max_images)

    def standardize(self, stats: dict) -> None:
        self.data.standardize(stats)

    def __len__(self) -> int:
        return int(self.captions.sum())

    def __getstate__(self) -> dict:  # workers need the shards, not the stores' readers
        state = dict(self.__dict__)
        state["data"] = copy.copy(self.data)
        state["data"].stores, state["data"].graphs = {}, None
        state["data"].captions = state["data"].caption_keys = []
        return state

    # -- epochs

    def _mine(self, epoch: int, rank: int, world: int, worker: int) -> np.ndarray:
        """This stream's shards (positions in ``self.shards``) for ``epoch``."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        return order[rank * self.workers + worker :: world * self.workers]

    def steps(self, world: int) -> int:
        """Steps per epoch on every rank: full batches the shards give the rank that gets
        the fewest, in the epoch where that is smallest."""
        fewest = min(
            sum(
                int(self.captions[self._mine(e, r, world, w)].sum()) // self.batch_size
                for w in range(self.workers)
            )
            for e in range(self.epochs)
            for r in range(world)
        )
        if fewest == 0:
            raise DataError(
                f"{self.url}: {len(self.shards)} train shards of {len(self)} captions fill no "
                f"batch of {self.batch_size} on some of {world} ranks x {self.workers} workers; "
                "rebuild with a smaller shards.samples_per_shard or lower train.num_workers"
            )
        return fewest

    def epoch_stream(self, epoch: int, rank: int, world: int):
        from models.data.batches import Stream

        return Stream((epoch, rank, world), self.steps(world))

    def stream(
        self, spec: tuple, worker: int, n_workers: int, alloc, start: dict | None = None
    ) -> Iterator[tuple[dict, dict]]:
        """Raw pair batches of one stream (see the class docstring), each with the
        stream's position after it (plain data). From ``start``, such a position, the
        stream goes on with the next batch: it reads only the groups that hold captions
        not yet given (the skip is computed from the position, not replayed).

        A position: the shard (in this stream's order) and group read next, the
        generator's state, and the captions held, in order, as ``(shard, group,
        caption)``; the first ``ready`` of them are shuffled and due in full batches."""
        from features.shards.reader import read_groups

        epoch, rank, world = spec
        mine = self._mine(epoch, rank, world, worker)
        rng = np.random.default_rng([self.seed, epoch, rank, worker])
        shard, group, ready, refs = 0, 0, 0, np.empty((0, 3), np.int64)
        if start is not None:
            shard, group, ready = start["shard"], start["group"], start["ready"]
            refs = np.asarray(start["refs"], np.int64).reshape(-1, 3)
            rng.bit_generator.state = _rng_state(start["rng"])
        url = [f"{self.url.rstrip('/')}/{self.shards[p]}" for p in mine]
        recorded = [self.recorded[p] for p in mine]  # members' CRC-32C
        held: dict[tuple[int, int], object] = {}
        for s in np.unique(refs[:, 0]):  # the groups of the captions held (a resume)
            wanted = set(refs[refs[:, 0] == s, 1].tolist())
            groups = read_groups(url[s], recorded[s], self.storage_options, wanted.__contains__)
            for g, read in enumerate(groups):
                if read is not None:
                    held[(int(s), g)] = read

        def opened():  # shard `shard` from group `group` (those before it are not decoded)
            if shard >= len(mine):
                return None
            keep = group.__le__
            return enumerate(read_groups(url[shard], recorded[shard], self.storage_options, keep))

        def position() -> dict:
            return {
                "shard": shard,
                "group": group,
                "ready": ready,
                "refs": refs.copy(),
                "rng": _rng_text(rng.bit_generator.state),
            }

        reading = opened()
        while True:
            while ready >= self.batch_size:
                chosen, refs = refs[: self.batch_size], refs[self.batch_size :]
                ready -= self.batch_size
                yield self._emit(held, chosen, alloc), position()
            ready = 0
            if reading is None:
                return
            got = next(reading, None)
            if got is None:  # this shard is done: the next one, or the stream's last batches
                shard, group = shard + 1, 0
                reading = opened()
                if reading is None:
                    refs, ready = refs[rng.permutation(len(refs))], len(refs)
                continue
            g, read = got
            if g < group:  # read before the position (not decoded)
                continue
            held[(shard, g)] = read
            n = int(read.caption_image.shape[0])
            new = np.stack([np.full(n, shard), np.full(n, g), np.arange(n)], 1)
            refs, group = np.concatenate([refs, new]), g + 1
            if len(refs) >= self.buffer:  # the buffer holds >= shuffle_buffer captions
                refs = refs[rng.permutation(len(refs))]
                ready = len(refs) // self.batch_size * self.batch_size
                kept = {(int(s), int(g)) for s, g in refs[:, :2]}
                held = {k: v for k, v in held.items() if k in kept}

    def _emit(self, held: dict, chosen: np.ndarray, alloc) -> dict[str, np.ndarray]:
        """The batch of captions ``chosen`` ``(shard, group, caption)``, rows in storage
        order (a random set of captions: each group's rows are copied in one slice)."""
        from features.shards.reader import GroupColumns

        chosen = chosen[np.lexsort((chosen[:, 2], chosen[:, 1], chosen[:, 0]))]
        keys, inverse = np.unique(chosen[:, :2], axis=0, return_inverse=True)
        groups = [held[(int(s), int(g))] for s, g in keys]
        images = {
            role: GroupColumns(groups, self.names[role], self.fields[role], "images")
            for role in self.names
            if role != "text"
        }
        text = None
        if "text" in self.names:
            text = GroupColumns(groups, "text", self.fields["text"], "captions")
        image_base = np.concatenate([[0], np.cumsum([g.n_images for g in groups])[:-1]])
        caption_image = [g.caption_image for g in groups]
        caption_base = np.concatenate([[0], np.cumsum([len(c) for c in caption_image])[:-1]])
        flat_image = np.concatenate(caption_image)
        inverse = inverse.reshape(-1)
        captions = caption_base[inverse] + chosen[:, 2]  # rows among the groups' captions
        rows = image_base[inverse] + flat_image[captions]  # rows among the groups' images
        out = image_arrays(self.data.inputs, images, {role: rows for role in images}, alloc)
        if text is not None:
            out.update(text_arrays(self.data.inputs, text, captions, self.info.tfidf_dim, alloc))
        index = np.concatenate([g.meta["index"] for g in groups])[rows]
        if "labels" in self.data.inputs:
            labels = np.concatenate([np.asarray(g.meta["labels"], np.int64) for g in groups])
            out["labels"] = out["text_labels"] = put(alloc, labels[rows])
        if "scene_graph" in self.data.inputs:
            graphs = [graph for g in groups for graph in g.meta["scene_graphs"]]
            batch = scene_graph_batch([graphs[c] for c in captions], self.data.word_index)
            out.update({k: v.numpy() for k, v in batch.items()})
        out["caption_image"] = put(alloc, index)
        keys = _KeysAt(self.data.image_keys, index)  # a caption is named by its image
        refuse_non_finite_inputs(
            out, {role: self.url for role, _ in FLOAT_INPUTS.values()}, keys, keys
        )
        return out


def _rng_text(state: dict) -> dict:
    """A numpy bit generator's state as plain data (its 128-bit integers as text)."""
    inner = {k: str(v) for k, v in state["state"].items()}
    return {**state, "state": inner}


def _rng_state(text: dict) -> dict:
    return {**text, "state": {k: int(v) for k, v in text["state"].items()}}
