"""Each request's own values of the parameters a policy's decode reads per request.

A policy names them (``KVPolicy.request_columns``: column -> value, an int or a float); its
runtime owns one ``RequestTable`` of them, a row per SGLang request slot, and writes a prefill's
requests' own rows before the forward; decode functions read a column by name, gathered by the
batch's ``req_pool_indices`` on the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

Values = Mapping[str, int | float]


def column_dtype(value: int | float) -> torch.dtype:
    """An int parameter stays an int (int32), a float one is float32."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a per-request decode value is an int or a float, got {value!r}")
    return torch.int32 if isinstance(value, int) else torch.float32


@dataclasses.dataclass(frozen=True)
class TableRows:
    """Rows to write, planned on the host: request slots and each column's values for them."""

    rows: torch.Tensor  # int64 [n]
    values: dict[str, torch.Tensor]  # column -> [n], its dtype


class RequestTable:
    """Named, typed columns [request slots] on ``device``, every row at ``defaults`` (the server's
    values) until a prefill writes a request's own."""

    def __init__(self, defaults: Values, rows: int, device):
        if not defaults:
            raise ValueError("a request table has at least one column")
        self.device = torch.device(device)
        self.dtypes = {name: column_dtype(value) for name, value in defaults.items()}
        self.columns = {
            name: torch.full((rows,), value, dtype=self.dtypes[name], device=device)
            for name, value in defaults.items()
        }

    def __getitem__(self, column: str) -> torch.Tensor:
        return self.columns[column]

    def plan(self, rows: Sequence[int], values: Sequence[Values]) -> TableRows:
        """Host tensors of ``values`` (one mapping per row, every column) for ``write``."""
        return TableRows(
            torch.tensor(list(rows), dtype=torch.int64),
            {
                name: torch.tensor([own[name] for own in values], dtype=dtype)
                for name, dtype in self.dtypes.items()
            },
        )

    def write(self, planned: TableRows) -> None:
        """Outside CUDA graphs, before the forward of the prefill that planned them."""
        rows = planned.rows.to(self.device)
        for name, column in self.columns.items():
            column[rows] = planned.values[name].to(self.device)
