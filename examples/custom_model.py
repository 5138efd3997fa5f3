"""Your own recommender on jitkern's kernels: a two-tower click model with manual backprop.

The DLRM in jitkern.dlrm is one composition of the public ops; this file is another, written
the way you would write yours. A user tower (user-id embedding -> MLP) and an item tower
(item-id + category embeddings, sum-pooled -> MLP) each produce a D-vector; the click logit
is their dot product. Every array operation is a jitkern op:

    forward                                   backward (reverse order, gradients named d<x>)
    embedding_bag_forward  (user, item, cat)  embedding_bag_adagrad_ (fused sparse grad + update)
    linear_forward  (ReLU fused)              linear_backward (ReLU mask fused)
    interaction_dot_forward (u . v)           interaction_dot_backward
    sigmoid_bce_forward                       sigmoid_bce_backward ; sgd_ for the dense weights

Run:  python examples/custom_model.py        (trains in a few seconds; prints AUC before/after)
"""
import numpy as np

from jitkern import ops
from jitkern.dlrm.metrics import roc_auc

N_USERS, N_ITEMS, N_CATS, D, RANK = 500, 200, 20, 16, 4


# --------------------------------------------------------------------------- data: a hidden taste model


def make_data(rng, n, user_f, item_f):
    """n (user, item, category, click) samples; clicks ~ sigmoid of hidden user/item affinity."""
    users = rng.integers(0, N_USERS, n)
    items = rng.integers(0, N_ITEMS, n)
    logit = 3.0 * (user_f[users] * item_f[items]).sum(axis=1) / np.sqrt(RANK) - 0.5
    clicks = (rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
    return users, items, items % N_CATS, clicks


# --------------------------------------------------------------------------- the model


class Tower:
    """Sum of embedding bags (one lookup per table per sample) -> Linear+ReLU -> Linear."""

    def __init__(self, rng, table_rows):
        self.tables = [rng.uniform(-0.1, 0.1, (r, D)).astype(np.float32) for r in table_rows]
        self.adagrad = [np.zeros(r, np.float32) for r in table_rows]       # row-wise Adagrad state
        self.w = [(rng.standard_normal((D, D)) * np.sqrt(2 / D)).astype(np.float32) for _ in range(2)]
        self.b = [np.zeros(D, np.float32) for _ in range(2)]

    def forward(self, ids):
        """ids: list of (B,) int64 per table -> (B, D); keeps what backward needs."""
        self.offsets = np.arange(len(ids[0]), dtype=np.int64)               # one index per bag
        self.ids = ids
        self.x = sum(ops.embedding_bag_forward(t, i, self.offsets) for t, i in zip(self.tables, ids))
        self.h = ops.linear_forward(self.x, self.w[0], self.b[0], activation="relu")
        self.y = ops.linear_forward(self.h, self.w[1], self.b[1])
        return self.y

    def backward_and_update(self, dy, lr_dense, lr_emb):
        dh, dw1, db1 = ops.linear_backward(dy, self.h, self.w[1])
        dx, dw0, db0 = ops.linear_backward(dh, self.x, self.w[0], self.h, activation="relu")
        for p, g in zip(self.w + self.b, [dw0, dw1, db0, db1]):
            ops.sgd_(p, g, lr_dense)
        for t, state, i in zip(self.tables, self.adagrad, self.ids):        # sum pooling: same dx for each
            ops.embedding_bag_adagrad_(t, state, i, self.offsets, dx, lr_emb)


class TwoTower:
    def __init__(self, seed=0):
        rng = np.random.default_rng(seed)
        self.user = Tower(rng, [N_USERS])
        self.item = Tower(rng, [N_ITEMS, N_CATS])

    def logits(self, users, items, cats):
        u = self.user.forward([users])
        v = self.item.forward([items, cats])
        self.u, self.v = u, v
        # z = [u, u . v]: the dot interaction of the 2 vectors; the logit is its last column
        return ops.interaction_dot_forward(u, [v])[:, D].copy()

    def train_step(self, users, items, cats, clicks, lr_dense=0.1, lr_emb=0.05):
        loss, probs = ops.sigmoid_bce_forward(self.logits(users, items, cats), clicks)
        dlogits = ops.sigmoid_bce_backward(probs, clicks)
        dz = np.zeros((len(clicks), D + 1), np.float32)
        dz[:, D] = dlogits
        du, dv = ops.interaction_dot_backward(dz, self.u, [self.v])
        self.user.backward_and_update(du, lr_dense, lr_emb)
        self.item.backward_and_update(np.ascontiguousarray(dv[:, 0]), lr_dense, lr_emb)
        return loss

    def predict(self, users, items, cats):
        return ops.sigmoid_bce_forward(self.logits(users, items, cats), np.zeros(len(users), np.float32))[1]


# --------------------------------------------------------------------------- train and evaluate


def main():
    rng = np.random.default_rng(42)
    user_f, item_f = rng.standard_normal((N_USERS, RANK)), rng.standard_normal((N_ITEMS, RANK))
    test = make_data(rng, 20_000, user_f, item_f)
    model = TwoTower()
    print(f"test AUC before training: {roc_auc(test[3], model.predict(*test[:3])):.4f}")
    batch = 512
    for step in range(1, 601):
        *features, clicks = make_data(rng, batch, user_f, item_f)
        loss = model.train_step(*features, clicks)
        if step % 150 == 0:
            auc = roc_auc(test[3], model.predict(*test[:3]))
            print(f"step {step}: train loss {loss:.4f}, test AUC {auc:.4f}")


if __name__ == "__main__":
    main()
