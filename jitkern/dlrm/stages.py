"""The stages of one DLRM training step (see jitkern.dlrm.model for the schedule), as a mixin of
DLRM: each takes the step's context and explicit arrays; the hybrid-parallel DLRM
(jitkern.dlrm.dist) overrides the `*_start` stages, `layer_done` and the stages that communicate.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..ops.gemm import backward_layer, forward_layer
from .model_state import SplitWeight
from .step import Buffers, StepContext
from .tables import MDTable, QRTable


def _gemm_operand(p):
    """What a GEMM reads of a weight: the array, or a Split pair's bf16 high half."""
    return p.hi if isinstance(p, SplitWeight) else p


class TrainStages:
    """The forward, backward and update stages of DLRM (its attributes: see DLRM)."""

    # ------------------------------------------------------------------ stages (forward)

    def _buffers_for(self, b: int) -> Buffers:
        buf = self._buffers.get(b)
        if buf is None:
            if len(self._buffers) >= 2:        # train + eval sizes; drop the oldest otherwise
                self._buffers.pop(next(iter(self._buffers)))
            buf = self._buffers[b] = Buffers(self, b)
        return buf

    def step_context(self, dense, offsets, indices, labels=None, lr=None) -> StepContext:
        """The context of one step on this batch (one process: all its rows)."""
        return StepContext(dense, offsets, indices, labels, lr, self._buffers_for(dense.shape[0]))

    def embedding_forward_start(self, ctx: StepContext) -> None:
        """Embedding work that can run ahead of the bottom MLP and overlap it (one process: none)."""

    def _layer_forward(self, h, w, b, out, act, out_mask=None, own_input=True):
        """One linear layer with activation act ("relu", "sigmoid" or None) into out (a BF16Array
        out: rounded once from the fp32 epilogue); a SplitWeight w: its bf16 half on bf16 h.
        out_mask: a ReLU's output mask, written too. own_input: h is the step's own array, not the
        caller's batch: an fp32 layer then skips the op's argument checks (its operands are the
        model's, valid by construction; the checks cost about what a small batch's layer does)."""
        if isinstance(w, SplitWeight):
            return ops.linear_forward(h, w.hi, b, activation=act, out=out)
        if own_input and type(h) is np.ndarray:
            y = forward_layer(h, w, b, out, act == "relu", out_mask)
        else:
            y = ops.linear_forward(h, w, b, activation="relu" if act == "relu" else None, out=out, out_mask=out_mask)
        return ops.sigmoid_forward(y, out=y) if act == "sigmoid" else y

    def _layer_backward(self, dy, x, w, y, act, outs, need_dx=True, input_relu=False, x_mask=None, own_input=True):
        """(dx, dw, db) of _layer_forward; y: its output; outs: (out_dx, out_dw), the step buffers
        they are written to; input_relu: x is a ReLU's output, dx comes back masked by it (by x_mask,
        its forward's out_mask, if given); own_input as _layer_forward's, for x. A SplitWeight w:
        bf16 GEMMs, dx bf16 (what the layer below and the interaction read), dw and db fp32."""
        out_dx, out_dw = outs
        if isinstance(w, SplitWeight):
            return ops.linear_backward(dy, x, w.hi, y, activation=act, need_dx=need_dx, dx_dtype="bfloat16",
                                       out_dx=out_dx, out_dw=out_dw, input_relu=input_relu)
        if act == "sigmoid":
            dy = ops.sigmoid_backward(dy, y)
        if own_input and type(x) is np.ndarray:
            return backward_layer(dy, x, w, y if act == "relu" else None, out_dx if need_dx else None, out_dw,
                                  input_relu, x_mask)
        return ops.linear_backward(dy, x, w, y, activation="relu" if act == "relu" else None, need_dx=need_dx,
                                   out_dx=out_dx, out_dw=out_dw, input_relu=input_relu, x_mask=x_mask)

    def _mlp_backward(self, ctx: StepContext, mlp: str, dy, first_x, need_first_dx):
        """Backward through the layers of `mlp` ("top" or "bottom") from dy at its output; first_x:
        what layer 0 read. With ReLU MLPs each layer's dx is masked by the ReLU below it in the dx
        GEMM's epilogue (input_relu), so that layer's backward takes it as it is (activation None).
        -> (dx at the MLP's input or None, [(dw, db) per layer])."""
        ws, outs_of, widths = ((self.top_w, ctx.buf.top, self.top_mlp) if mlp == "top"
                               else (self.bot_w, ctx.buf.bot, self.bottom_mlp))
        grads = [None] * len(ws)
        last, masked = len(ws) - 1, False
        masks = self._relu_masks(ctx, mlp)
        for l in range(last, -1, -1):
            x = first_x if l == 0 else outs_of[l - 1]
            act = None if (masked or (mlp == "top" and l == last)) else self.activation
            fuse = l > 0 and self.activation == "relu"
            need_dx = l > 0 or need_first_dx
            outs = ctx.buf.grads(mlp, l, (widths[l + 1], widths[l]), need_dx)
            dy, dw, db = self._layer_backward(dy, x, ws[l], outs_of[l], act, outs, need_dx=need_dx, input_relu=fuse,
                                              x_mask=masks[l - 1] if fuse and masks else None,
                                              own_input=l > 0 or mlp == "top")
            masked = fuse
            grads[l] = (dw, db)
            self.layer_done(ctx, mlp, (l, dw, db))
        return dy, grads

    def bottom_forward(self, ctx: StepContext):
        """x = bottom MLP(dense); dense: (b, n_dense) -> x: (b, D), the activation after every layer."""
        with self.timer("bottom_fwd"):
            h = self._bottom_input(ctx)
            masks = self._relu_masks(ctx, "bottom")
            for l, (w, b, out) in enumerate(zip(self.bot_w, self.bot_b, ctx.buf.bot)):
                h = self._layer_forward(h, w, b, out, self.activation, out_mask=masks[l] if masks else None,
                                        own_input=l > 0)
                self.layer_done(ctx, "bottom", None)
            return h

    @staticmethod
    def _relu_masks(ctx: StepContext, mlp: str):
        """The ReLU output masks of `mlp` that a training step's forward writes and its backward
        reads (None: inference, or none kept)."""
        return ctx.buf.relu_masks[mlp] if ctx.lr is not None else None

    def _bottom_input(self, ctx: StepContext):
        """The bottom MLP's input: the dense features, rounded to bf16 (in place of the step's
        buffer) for bf16 MLPs."""
        if self.precision != "bf16":
            return ctx.dense
        return ops.BF16Array.from_float32(ctx.dense, out=ctx.buf.dense16)

    def embedding_forward(self, ctx: StepContext) -> list:
        """ly[t] = sum-pooled rows of table t for this process's rows; -> ly: T arrays (b, D)."""
        with self.timer("embedding_fwd"):
            if self.pool_w is not None:
                ctx.psw = [v[idx] for v, idx in zip(self.pool_w, ctx.indices)]
            for t, w in enumerate(self.emb):
                psw = None if ctx.psw is None else ctx.psw[t]
                if isinstance(w, (QRTable, MDTable)):
                    w.forward(ctx.indices[t], ctx.offsets[t], ctx.buf.ly[t])
                elif isinstance(w, ops.QuantizedTable):
                    ops.embedding_bag_quantized_forward(w, ctx.indices[t], ctx.offsets[t], per_sample_weights=psw,
                                                        out=ctx.buf.ly[t])
                else:
                    ops.embedding_bag_forward(w, ctx.indices[t], ctx.offsets[t], per_sample_weights=psw,
                                              out=ctx.buf.ly[t])
            if self.precision == "bf16":        # what the bf16 interaction reads
                ops.BF16Array.from_float32(ctx.buf.pooled, out=ctx.buf.pooled16)
                return ctx.buf.ly16
            return ctx.buf.ly

    def interaction_forward(self, ctx: StepContext, x, ly):
        """z: (b, top_mlp[0]) from x: (b, D) and ly: T arrays (b, D)."""
        with self.timer("interaction"):
            if self.interaction == "dot":
                out_dtype = "bfloat16" if self.precision == "bf16" else None
                return ops.interaction_dot_forward(x, ly, self_interaction=self.self_interaction, out_dtype=out_dtype)
            z = ops.interaction_cat_forward(x, ly)
            if self.interaction == "dcn":
                z = self._cross_forward(ctx, z)
            return z

    def _cross_forward(self, ctx: StepContext, x0):
        """The cross network on x0 (b, n): each layer's output, u and (training) y + b into the
        step's buffers."""
        ctx.cross_x0 = xl = x0
        buf = ctx.buf
        for l, (v, w, b) in enumerate(zip(self.cross_v, self.cross_w, self.cross_b)):
            keep = buf.cross_y[l] if ctx.lr is not None else None
            xl, _ = ops.cross_layer_forward(x0, xl, _gemm_operand(v), _gemm_operand(w), b, out=buf.cross_x[l],
                                            out_u=buf.cross_u[l], out_y=keep)
        return xl

    def _cross_backward(self, ctx: StepContext, dz):
        """The cross network's backward from dz = dloss/dx_L (b, n): -> dloss/dx0; the layers'
        (dv, dw, db) into ctx.cross_grads. dz's buffer carries dxl from layer to layer."""
        x0, L = ctx.cross_x0, len(self.cross_v)
        if L == 0:
            return dz
        grads = [None] * L
        # the top MLP's own dx (updated in place), or its bf16 dx widened
        d = dz.to_float32() if isinstance(dz, ops.BF16Array) else np.require(dz, np.float32, ("C", "W"))
        dx0 = None
        for l in range(L - 1, -1, -1):
            xl = x0 if l == 0 else ctx.buf.cross_x[l - 1]
            dx0, d, dv, dw, db = ops.cross_layer_backward(d, x0, xl, ctx.buf.cross_u[l], _gemm_operand(self.cross_v[l]),
                                                          _gemm_operand(self.cross_w[l]), self.cross_b[l],
                                                          y=ctx.buf.cross_y[l], accumulate_dx0=dx0, out_dxl=d)
            grads[l] = (dv, dw, db)
        ctx.cross_grads = grads
        return np.add(dx0, d, out=dx0)                 # x0 is layer 0's xl too

    def top_forward(self, ctx: StepContext, z):
        """logits: (b,) from z; the activation on hidden layers, none on the last (the loss applies sigmoid)."""
        with self.timer("top_fwd"):
            h = z
            last = len(self.top_w) - 1
            masks = self._relu_masks(ctx, "top")
            for l, (w, b, out) in enumerate(zip(self.top_w, self.top_b, ctx.buf.top)):
                h = self._layer_forward(h, w, b, out, None if l == last else self.activation,
                                        out_mask=masks[l] if masks and l < last else None)
            return h.reshape(-1)

    @property
    def _plain_bce(self) -> bool:
        return self.loss == "bce" and self.loss_threshold == 0.0

    def _loss_kwargs(self) -> dict:
        return dict(loss=self.loss, class_weights=self.loss_weights, threshold=self.loss_threshold)

    def loss_forward(self, ctx: StepContext, logits):
        """(batch-mean loss of this process's rows, probs (b,)) from logits; inference: probs only."""
        labels = ctx.buf.zero_labels if ctx.labels is None else ctx.labels
        ctx.logits = logits
        with self.timer("loss"):
            if self._plain_bce:
                return ops.sigmoid_bce_forward(logits, labels)
            return ops.sigmoid_loss_forward(logits, labels, **self._loss_kwargs())

    # ------------------------------------------------------------------ stages (backward, update)

    def loss_backward(self, ctx: StepContext, probs):
        """dloss/dlogits: (b,)."""
        with self.timer("loss"):
            if self._plain_bce:
                return ops.sigmoid_bce_backward(probs, ctx.labels)
            return ops.sigmoid_loss_backward(ctx.logits, ctx.labels, **self._loss_kwargs())

    def top_backward(self, ctx: StepContext, dlogits, z):
        """Top MLP backward; -> (dz, [(dw, db) per layer])."""
        with self.timer("top_bwd"):
            return self._mlp_backward(ctx, "top", dlogits.reshape(-1, 1), z, True)

    def interaction_backward(self, ctx: StepContext, dz, x, ly):
        """-> (dx (b, D), dly (b, T, D))."""
        with self.timer("interaction"):
            if self.interaction == "dot":
                return ops.interaction_dot_backward(dz, x, ly, self_interaction=self.self_interaction)
            if self.interaction == "dcn":
                dz = self._cross_backward(ctx, dz)
            return ops.interaction_cat_backward(dz, x, ly)

    def embedding_backward_start(self, ctx: StepContext, dly) -> None:
        """Embedding-gradient work that can run ahead of the bottom MLP backward and overlap it
        (one process: none; embedding_update fuses the backward into the update)."""

    def bottom_backward(self, ctx: StepContext, dx):
        """Bottom MLP backward; -> [(dw, db) per layer] (the gradient w.r.t. dense is not needed)."""
        with self.timer("bottom_bwd"):
            first = ctx.buf.dense16 if self.precision == "bf16" else ctx.dense    # what layer 0 read
            return self._mlp_backward(ctx, "bottom", dx, first, False)[1]

    def layer_done(self, ctx: StepContext, mlp: str, grads) -> None:
        """Called after each MLP layer ("bottom" or "top"; grads None in forward, (layer, dw, db) in
        backward): where the distributed model progresses and buckets its communication."""

    def embedding_update(self, ctx: StepContext, dly) -> None:
        """Fused sparse backward + update per table (the table optimizer's); learned pooling
        weights take their gradient first, from the tables before their update."""
        with self.timer("embedding_upd"):
            if self.pool_w is not None:
                self._pool_weight_update(ctx, dly)
            for t, w in enumerate(self.emb):
                if isinstance(w, (QRTable, MDTable)):
                    w.update(ctx.indices[t], ctx.offsets[t], dly[:, t], ctx.lr, self.table_opt, self.dense_opt)
                    continue
                psw = None if ctx.psw is None else ctx.psw[t]
                self.table_opt.update(w, self.opt_state.get(f"emb.{t}.weight"), ctx.indices[t], ctx.offsets[t],
                                      dly[:, t], ctx.lr, per_sample_weights=psw)

    def _pool_weight_update(self, ctx: StepContext, dly) -> None:
        """Learned pooling: each lookup's weight gradient (dot of its bag's gradient and its row),
        summed per row in lookup order, through the dense optimizer on the rows it touches."""
        for t, (v, w) in enumerate(zip(self.pool_w, self.emb)):
            idx = ctx.indices[t]
            dpsw = ops.embedding_bag_per_sample_weights_backward(w, idx, ctx.offsets[t], dly[:, t])
            rows, inverse = np.unique(idx, return_inverse=True)
            grad = np.zeros(len(rows), np.float32)
            np.add.at(grad, inverse, dpsw)
            vr = v[rows]
            state = self.opt_state.get(f"emb.{t}.pool_weight")
            sr = None if state is None else state[rows]
            self.dense_opt.step(vr, sr, grad, ctx.lr)
            v[rows] = vr
            if state is not None:
                state[rows] = sr

    def dense_update(self, ctx: StepContext, bot_grads, top_grads) -> None:
        """The dense optimizer on every MLP weight and bias."""
        with self.timer("dense_upd"):
            for prefix, ws, bs, grads in (("bot", self.bot_w, self.bot_b, bot_grads),
                                          ("top", self.top_w, self.top_b, top_grads)):
                for l, (w, b, (dw, db)) in enumerate(zip(ws, bs, grads)):
                    self._step(w, self.opt_state.get(f"{prefix}.{l}.weight"), dw, ctx.lr)
                    self._step(b, self.opt_state.get(f"{prefix}.{l}.bias"), db, ctx.lr)
            self._cross_update(ctx)

    def _step(self, p, state, grad, lr) -> None:
        """The dense optimizer on one parameter: an fp32 array, or a Split pair updated in fp32."""
        if isinstance(p, SplitWeight):
            p.step(self.dense_opt, state, grad, lr)
        else:
            self.dense_opt.step(p, state, grad, lr)

    def _cross_update(self, ctx: StepContext) -> None:
        """The dense optimizer on the cross network's parameters (dcn)."""
        for l, grads in enumerate(ctx.cross_grads or ()):
            for name, p, g in zip("vwb", (self.cross_v[l], self.cross_w[l], self.cross_b[l]), grads):
                self._step(p, self.opt_state.get(f"cross.{l}.{name}"), g, ctx.lr)

    def step_loss(self, ctx: StepContext, loss) -> float:
        """The batch-mean loss train_step returns."""
        return float(loss)

    def forward_result(self, ctx: StepContext, probs):
        """The click probabilities of the whole batch that forward returns."""
        return probs
