"""The distributed DLRM's arrays by name, as model_state.py's for one process: each table's piece
this rank holds, the whole model and optimizer state assembled on every rank (collectives), and a
checkpoint's full arrays loaded back piece by piece. A mixin of DistributedDLRM (self: the model:
shards, comm, rank, table_opt, the MLP state of ModelState)."""
from __future__ import annotations

import numpy as np

from .model_state import copy_into


class DistState:
    """Named arrays of a DistributedDLRM; its methods take precedence over ModelState's."""

    def table_regions(self) -> dict:
        return {s.t: s.region for s in self.shards if s.held}

    def saves_region(self, t: int) -> bool:
        """Whether this rank writes its piece of table t to a checkpoint (rank 0 for replicas)."""
        s = self.shards[t]
        return s.held and (s.kind != "replicate" or self.rank == 0)

    def read_region(self, t: int) -> np.ndarray:
        return self.shards[t].read()

    def write_region(self, t: int, block) -> None:
        self.shards[t].write(block)

    def table_state(self, t: int):
        return self.shards[t].state

    def _full(self, s, mine, shape) -> np.ndarray:
        """Collective: table s's whole array of `shape` ((rows, D); (rows,) for per-row state) from its
        holders' blocks; mine: this rank's block (None where it holds none). A replica's block, and
        a whole table's on its holder, is returned as given (the live array where it is one)."""
        if s.kind == "replicate":
            return mine
        if s.kind == "table":
            full = mine if s.held else np.empty(shape, np.float32)
            self.comm.Bcast(full, root=s.spec.ranks[0])
            return full
        full = np.empty(shape, np.float32)
        for j, holder in enumerate(s.spec.ranks):
            r0, r1, c0, c1 = s.spec.region(j, s.rows, self.embedding_dim)
            if len(shape) == 1 and c0 > 0:
                continue                            # per-row state: every column piece holds the same
            target = full[r0:r1] if len(shape) == 1 else full[r0:r1, c0:c1]
            piece = mine if holder == self.rank else np.empty(target.shape, np.float32)
            self.comm.Bcast(np.ascontiguousarray(piece), root=holder)
            target[...] = piece
        return full

    def state_dict(self) -> dict:
        """Collective: the full model on every rank (each piece broadcast from its holder)."""
        sd = {f"emb.{t}.weight": self._full(s, s.read() if s.held else None, (s.rows, self.embedding_dim))
              for t, s in enumerate(self.shards)}
        sd.update(self.mlp_state_dict())
        return sd

    def optimizer_state_dict(self) -> dict:
        """Collective: the full optimizer state on every rank, named as one process names it: the
        tables' assembled from their pieces, the dense parameters' (the same on every rank) live."""
        out = self.dense_state_dict()
        for t, s in enumerate(self.shards):
            shape = self.table_opt.state_shape(s.rows, self.embedding_dim)
            if shape is not None:
                out[f"state.emb.{t}.weight"] = self._full(s, s.state, shape)
        return out

    def optimizer_state_shapes(self) -> dict:
        shapes = {k: v.shape for k, v in self.dense_state_dict().items()}
        for t, rows in enumerate(self.embedding_sizes):
            shape = self.table_opt.state_shape(rows, self.embedding_dim)
            if shape is not None:
                shapes[f"state.emb.{t}.weight"] = shape
        return shapes

    def load_local(self, sd: dict) -> None:
        """Copy the given, already checked full arrays: each table's piece this rank holds (and its
        optimizer state), the MLPs and the cross network (and theirs)."""
        dense = self.mlp_parameters()
        for name, a in sd.items():
            if name.startswith("state."):
                self._load_state(name[len("state."):], a)
            elif name in dense:
                copy_into(dense[name], a)
            else:                                   # emb.{t}.weight
                s = self.shards[int(name.split(".")[1])]
                if s.held:
                    r0, r1, c0, c1 = s.region
                    s.write(a[r0:r1, c0:c1])

    def _load_state(self, name: str, a) -> None:
        """The optimizer state of parameter `name` from the full array a: a table's, my region of it."""
        if not name.startswith("emb."):
            np.copyto(self.opt_state[name], a)
            return
        s = self.shards[int(name.split(".")[1])]
        if s.held:
            r0, r1, c0, c1 = s.region
            np.copyto(s.state, a[r0:r1] if a.ndim == 1 else a[r0:r1, c0:c1])
