"""The DLRM's arrays by name: parameters (state_dict, as torch's), the optimizer's state, what a
checkpoint holds, and loading them back, checked before anything is copied. A mixin of DLRM."""
from __future__ import annotations

import numpy as np

from .. import ops
from .tables import MDTable, QRTable


class SplitWeight:
    """An fp32 MLP weight held as a bf16 Split pair (precision "bf16"): `hi`, the BF16Array the
    GEMMs read (the weight truncated to bf16), and `lo`, its uint16 low halves; together exactly
    the fp32 weight, which the update rejoins, changes in fp32 and splits again."""
    __slots__ = ("hi", "lo")

    def __init__(self, w: np.ndarray):
        self.hi, self.lo = ops.split_float32(w)

    @property
    def shape(self) -> tuple:
        return self.hi.shape

    @property
    def nbytes(self) -> int:
        return self.hi.nbytes + self.lo.nbytes

    def flat(self, a=0, b=None) -> "SplitWeight":
        """Elements a:b of the flattened weight, as a SplitWeight of views (updated in place)."""
        piece = SplitWeight.__new__(SplitWeight)
        piece.hi, piece.lo = ops.BF16Array(self.hi.bits.reshape(-1)[a:b]), self.lo.reshape(-1)[a:b]
        return piece

    def to_float32(self) -> np.ndarray:
        """The exact fp32 weight (a new array)."""
        return ops.join_float32(self.hi, self.lo)

    def assign(self, w: np.ndarray) -> None:
        """Hold the fp32 weight w (of this shape) from now on, in place."""
        hi, lo = ops.split_float32(np.ascontiguousarray(w, np.float32))
        np.copyto(self.hi.bits, hi.bits)
        np.copyto(self.lo, lo)

    def step(self, opt, state, grad, lr) -> None:
        """The dense optimizer's update in fp32: SGD fused on the pair (ops.split_sgd_), any other
        on the rejoined weight, split again."""
        if opt.name == "sgd":
            ops.split_sgd_(self.hi, self.lo, grad, lr)
            return
        w = self.to_float32()
        opt.step(w, state, grad, lr)
        self.assign(w)


def copy_into(p, a: np.ndarray) -> None:
    """Copy the fp32 array a into the live parameter p: an array, or a SplitWeight split again."""
    if isinstance(p, SplitWeight):
        p.assign(a)
    else:
        np.copyto(p, a)


class ModelState:
    """Named arrays of a DLRM (self: the model: emb, pool_w, opt_state, the MLP lists)."""

    def parameter_bytes(self) -> int:
        """Bytes of the parameters this process holds (a bf16 split table counts both halves)."""
        dense = sum(a.nbytes for a in self.bot_w + self.bot_b + self.top_w + self.top_b)
        dense += sum(a.nbytes for a in self.cross_v + self.cross_w + self.cross_b)
        return dense + sum(_table_nbytes(w) for w in self.emb if w is not None) + \
            sum(v.nbytes for v in self.pool_w or ())

    def mlp_parameters(self) -> dict:
        """name -> every dense parameter as held: MLP weights and biases (fp32 arrays, or SplitWeight
        pairs in bf16), and between the bottom and top MLPs the cross network's (dcn: cross.{l}.v
        (r, n), .w (n, r), .b (n,), torch's layout; fp32)."""
        sd = {}
        for prefix, ws, bs in (("bot", self.bot_w, self.bot_b), ("top", self.top_w, self.top_b)):
            if prefix == "top":
                sd.update(self._cross_arrays())
            for l, (w, b) in enumerate(zip(ws, bs)):
                sd[f"{prefix}.{l}.weight"] = w
                sd[f"{prefix}.{l}.bias"] = b
        return sd

    def mlp_state_dict(self) -> dict:
        """name -> fp32 array of every MLP weight and bias: the live array, or a Split pair rejoined."""
        return {k: p.to_float32() if isinstance(p, SplitWeight) else p for k, p in self.mlp_parameters().items()}

    def _cross_arrays(self) -> dict:
        return {f"cross.{l}.{k}": a for l, vwb in enumerate(zip(self.cross_v, self.cross_w, self.cross_b))
                for k, a in zip("vwb", vwb)}

    def _table_arrays(self) -> dict:
        """name -> live array of every table parameter (fp32 tables; bf16 ones are left out)."""
        sd = {}
        for t, w in enumerate(self.emb):
            if isinstance(w, np.ndarray):
                sd[f"emb.{t}.weight"] = w
            elif isinstance(w, (QRTable, MDTable)):
                sd.update({f"emb.{t}.{k}": a for k, a in w.arrays().items()})
        for t, v in enumerate(self.pool_w or ()):
            sd[f"emb.{t}.pool_weight"] = v
        return sd

    def state_dict(self) -> dict:
        """name -> fp32 array; fp32 tables and MLP arrays are the live parameters (no copies), bf16
        Split pairs (tables, MLP weights) rejoined copies."""
        sd = {f"emb.{t}.weight": w.to_float32() for t, w in enumerate(self.emb) if isinstance(w, ops.SplitBF16Table)}
        sd.update(self._table_arrays())
        sd = {k: sd[k] for k in sorted(sd, key=_emb_order)}
        sd.update(self.mlp_state_dict())
        return sd

    def table_regions(self) -> dict:
        """table -> (r0, r1, c0, c1): the rows and columns of it this process holds (all, here)."""
        return {t: (0, r, 0, self.embedding_dim) for t, r in enumerate(self.embedding_sizes)}

    def saves_region(self, t: int) -> bool:
        """Whether this process writes its region of table t to a sharded checkpoint."""
        return True

    def read_region(self, t: int) -> np.ndarray:
        """Table t's region as fp32 (the live table where it is fp32)."""
        w = self.emb[t]
        return w if isinstance(w, np.ndarray) else w.to_float32()

    def write_region(self, t: int, block) -> None:
        """Set table t's region from an fp32 block of its shape."""
        if isinstance(self.emb[t], np.ndarray):
            np.copyto(self.emb[t], block)
        else:
            self.emb[t] = ops.SplitBF16Table.from_float32(np.ascontiguousarray(block, np.float32))

    def optimizer_state_dict(self) -> dict:
        """"state.<parameter name>" -> the live optimizer state of that parameter (none for SGD)."""
        out = {f"state.{k}": v for k, v in self.opt_state.items()}
        for t, w in enumerate(self.emb):
            if isinstance(w, (QRTable, MDTable)):
                out.update({f"state.emb.{t}.{k}": v for k, v in w.states().items()})
        return out

    def dense_state_dict(self) -> dict:
        """"state.<parameter name>" -> the live optimizer state of every dense parameter (MLPs, cross network)."""
        return {f"state.{k}": self.opt_state[k] for k in self.mlp_parameters() if k in self.opt_state}

    def table_state(self, t: int):
        """The live optimizer state of table t's region (table_regions), None for SGD: (rows, width)
        element-wise, (rows,) per row."""
        return self.opt_state.get(f"emb.{t}.weight")

    def optimizer_state_shapes(self) -> dict:
        """name -> shape of everything optimizer_state_dict holds."""
        return {k: v.shape for k, v in self.optimizer_state_dict().items()}

    def checkpoint_arrays(self) -> dict:
        """What a checkpoint holds: the parameters and the optimizer's state."""
        sd = self.state_dict()
        sd.update(self.optimizer_state_dict())
        return sd

    def state_shapes(self) -> dict:
        """name -> shape of every parameter (what load_state_dict expects), without building copies."""
        shapes = {k: a.shape for k, a in self._table_arrays().items()}
        # plain tables by their full shape: a sharded model holds only a piece of some
        shapes.update({f"emb.{t}.weight": (r, self.embedding_dim) for t, r in enumerate(self.embedding_sizes)
                       if not isinstance(self.emb[t], (QRTable, MDTable))})
        shapes = {k: shapes[k] for k in sorted(shapes, key=_emb_order)}
        for prefix, sizes in (("bot", self.bottom_mlp), ("top", self.top_mlp)):
            if prefix == "top":
                shapes.update({k: a.shape for k, a in self._cross_arrays().items()})
            for l, (n, m) in enumerate(zip(sizes[:-1], sizes[1:])):
                shapes[f"{prefix}.{l}.weight"] = (m, n)
                shapes[f"{prefix}.{l}.bias"] = (m,)
        return shapes

    def checkpoint_shapes(self) -> dict:
        """name -> shape of everything checkpoint_arrays holds."""
        shapes = self.state_shapes()
        shapes.update(self.optimizer_state_shapes())
        return shapes

    def load_state_dict(self, sd: dict) -> None:
        """Copy every parameter from `sd` (the full model; optimizer state too where it holds
        "state." entries) after checking names, dtypes and shapes, all before any copy; tables this
        process does not hold are skipped."""
        shapes = self.state_shapes()
        if any(k.startswith("state.") for k in sd):
            shapes = self.checkpoint_shapes()
        missing = sorted(set(shapes) - set(sd))
        extra = sorted(set(sd) - set(shapes))
        if missing or extra:
            raise KeyError(f"state_dict does not match this model: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, shape in shapes.items():
            a = sd[name]
            if not isinstance(a, np.ndarray) or a.dtype != np.float32:
                raise TypeError(f"state_dict[{name!r}] must be a float32 ndarray, got "
                                f"{getattr(a, 'dtype', type(a).__name__)}")
            if a.shape != shape:
                raise ValueError(f"state_dict[{name!r}] has shape {a.shape}, expected {shape}")
        self.load_local(sd)

    def load_local(self, sd: dict) -> None:
        """Copy the given, already checked arrays into the parameters; tables this process does not
        hold are ignored (a sharded checkpoint gives each rank only its own)."""
        live = self._table_arrays()
        live.update(self.mlp_parameters())
        live.update(self.optimizer_state_dict())
        for name, a in sd.items():
            if name in live:
                copy_into(live[name], a)
                continue
            t = int(name.split(".")[1])                 # a bf16 table (absent tables: None)
            if self.emb[t] is not None:
                self.emb[t] = ops.SplitBF16Table.from_float32(a)

    def quantize_tables(self, bits: int) -> None:
        """For inference: every table becomes row-wise quantized (ops.QuantizedTable, 8 or 4 bits)."""
        if any(not isinstance(w, np.ndarray) for w in self.emb):
            raise ValueError("quantize_tables needs plain fp32 tables (no qr, md, bf16 or distributed tables)")
        self.emb = [ops.quantize_rowwise(w, bits) for w in self.emb]


def arch_extras(*, optimizer="sgd", weighted_pooling=None, qr=None, md_dims=None, dcn=None) -> dict:
    """The checkpoint architecture's entries for the reference's options that shape arrays (none when
    all are off, so plain checkpoints read as before); dcn: (layers, rank) of a dcn model."""
    out = {}
    if dcn is not None:
        out["dcn_layers"], out["dcn_rank"] = int(dcn[0]), int(dcn[1])
    if optimizer != "sgd":
        out["optimizer"] = optimizer
    if weighted_pooling == "learned":
        out["weighted_pooling"] = weighted_pooling
    if qr is not None:
        out["qr"] = [qr.threshold, qr.collisions, qr.operation]
    if md_dims is not None:
        out["md_dims"] = [None if d is None else int(d) for d in md_dims]
    return out


def _table_nbytes(w) -> int:
    if isinstance(w, np.ndarray):
        return w.nbytes
    if isinstance(w, ops.SplitBF16Table):
        return w.hi.nbytes + w.lo.nbytes
    if isinstance(w, ops.QuantizedTable):
        return w.data.nbytes
    return sum(a.nbytes for a in w.arrays().values())


def _emb_order(name: str):
    """Sort key of table parameter names: by table, then as the reference lists them."""
    _, t, what = name.split(".")
    return int(t), what
