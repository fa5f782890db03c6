"""Several embedding tables fed by jagged features, looked up together: TorchRec's
``EmbeddingBagCollection`` shape, without TorchRec.

    tables = EmbeddingBagCollection({"items": nn.EmbeddingBag(4_000_000, 32, mode="sum"),
                                     "users": nn.EmbeddingBag(500_000, 32, mode="sum")})
    pooled = tables({"items": JaggedTensor(...), "users": JaggedTensor(...)})
    pooled["items"]   # (examples, 32)

A plain module anywhere; in a parameter-server job whose tables are served by rows, one
forward asks each ps once for the rows of all its tables (a model that calls its tables
one by one asks once per table).
"""

from __future__ import annotations

import torch

from ..distribute.jagged import JaggedTensor
from .embedding_lookup import bag, looked_up, unique_ids

__all__ = ["EmbeddingBagCollection"]


class EmbeddingBagCollection(torch.nn.Module):
    """Named ``nn.EmbeddingBag`` tables; ``features`` maps each feature to its table
    (default: each table's own name). ``forward(features)`` takes a dict of
    :class:`~csrun.core.distribute.jagged.JaggedTensor` (one per feature) and returns a
    dict of pooled embeddings, one ``(examples, dim)`` tensor per feature."""

    def __init__(self, tables: dict[str, torch.nn.EmbeddingBag],
                 features: dict[str, str] | None = None):
        super().__init__()
        self.tables = torch.nn.ModuleDict(tables)
        self.features = dict(features) if features is not None else {n: n for n in tables}
        unknown = sorted(set(self.features.values()) - set(tables))
        if unknown:
            raise ValueError(f"features name tables that are not in the collection: "
                             f"{', '.join(unknown)}")

    def forward(self, features: dict[str, JaggedTensor]) -> dict[str, torch.Tensor]:
        served = {name: getattr(table, "csrun_row_table", None)
                  for name, table in self.tables.items()}
        if all(t is not None and t.fetch_many is not None for t in served.values()):
            return _collected(self, served, features)  # tables served by rows: together
        return {feature: self.tables[table](features[feature].values,
                                            features[feature].bag_offsets(),
                                            per_sample_weights=features[feature].weights)
                for feature, table in self.features.items()}


def _collected(collection: EmbeddingBagCollection, served: dict,
               features: dict[str, JaggedTensor]) -> dict[str, torch.Tensor]:
    """The pooled features, every table's rows fetched in one request per ps."""
    prepared = []
    for feature, name in collection.features.items():
        module, table = collection.tables[name], served[name]
        prepared.append((feature, module, table,
                         *unique_ids(module, table, features[feature].values)))
    fetched = prepared[0][2].fetch_many([(table.var, unique)
                                         for _, _, table, unique, _ in prepared]) \
        if prepared else []
    out = {}
    for (feature, module, table, unique, inverse), rows in zip(prepared, fetched):
        jagged = features[feature]
        out[feature] = bag(module, inverse, *looked_up(module, table, unique, rows),
                           jagged.bag_offsets(), jagged.weights)
    return out
