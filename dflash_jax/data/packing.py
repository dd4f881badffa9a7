"""First-fit packing of tokenised documents into fixed-length rows (grain), and its inverse.

A packed batch is a dict of int32 ``[rows, max_length]`` arrays::

    input_ids    tokens; padding = pad id
    positions    0, 1, 2, ... restarting at every document; 0 on padding
    segment_ids  1, 1, 1, 2, 2, 0, 0   documents numbered from 1 within a row; 0 = padding
    loss_mask    1 on trained (assistant) tokens, else 0

Packing is grain's ``FirstFitPackIterDataset`` (a set of ``num_bins`` open rows; a document goes
to the first row with room; when one fits nowhere all rows are emitted). Its iterator state holds
the parent position of the open rows, so a restored pipeline re-packs the same rows exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import grain
import numpy as np
from grain import experimental as grain_exp

BATCH_KEYS = ("input_ids", "positions", "segment_ids", "loss_mask")


def truncate_document(input_ids: np.ndarray, loss_mask: np.ndarray, max_length: int) -> dict:
    """Keep the first ``max_length`` tokens of a document."""
    return {
        "input_ids": np.asarray(input_ids[:max_length], dtype=np.int32),
        "loss_mask": np.asarray(loss_mask[:max_length], dtype=np.int32),
    }


class _StackRows:
    """Stack packed rows into a batch, padding a short final batch with empty rows (static shapes)."""

    def __init__(self, rows: int, max_length: int, pad_id: int):
        self.rows, self.max_length, self.pad_id = rows, max_length, pad_id

    def __call__(self, elements: Sequence[dict]) -> dict:
        out = {}
        for key, src in (
            ("input_ids", "input_ids"),
            ("positions", "input_ids_positions"),
            ("segment_ids", "input_ids_segment_ids"),
            ("loss_mask", "loss_mask"),
        ):
            fill = self.pad_id if key == "input_ids" else 0
            arr = np.full((self.rows, self.max_length), fill, dtype=np.int32)
            for r, el in enumerate(elements):
                arr[r] = el[src]
            out[key] = arr
        return out


def pack_and_batch(
    docs: grain.IterDataset,
    *,
    max_length: int,
    rows: int,
    num_bins: int,
    pad_id: int,
    seed: int,
    shuffle_bins: bool,
) -> grain.IterDataset:
    """Documents ``{"input_ids", "loss_mask"}`` (each <= max_length) -> packed batches of ``rows``."""
    packed = grain_exp.FirstFitPackIterDataset(
        docs,
        length_struct={"input_ids": max_length, "loss_mask": max_length},
        num_packing_bins=num_bins,
        seed=seed,
        shuffle_bins=shuffle_bins,
        padding_struct={"input_ids": pad_id, "loss_mask": 0},
    )
    return packed.batch(rows, drop_remainder=False, batch_fn=_StackRows(rows, max_length, pad_id))


def unpack_documents(batch: dict) -> list[dict]:
    """Inverse of packing: the documents of a batch, row by row, as ``{"input_ids", "loss_mask"}``.

    Checks the layout on the way (positions restart at 0 per document, padding only at row ends)
    and raises ``ValueError`` if it is broken.
    """
    ids, pos, seg, mask = (np.asarray(batch[k]) for k in BATCH_KEYS)
    docs = []
    for r in range(ids.shape[0]):
        s = seg[r]
        n_real = int(np.count_nonzero(s))
        if np.any(s[n_real:] != 0) or np.any(s[:n_real] == 0):
            raise ValueError(f"row {r}: padding (segment 0) is not only at the end")
        if np.any(mask[r, n_real:]):
            raise ValueError(f"row {r}: loss on padding")
        if n_real and (s[0] != 1 or np.any(np.diff(s[:n_real]) < 0) or np.any(np.diff(s[:n_real]) > 1)):
            raise ValueError(f"row {r}: segment ids must count up 1, 2, ... within the row")
        for d in range(1, int(s.max(initial=0)) + 1):
            sel = np.nonzero(s == d)[0]
            if not np.array_equal(pos[r, sel], np.arange(sel.size)):
                raise ValueError(f"row {r} document {d}: positions do not run 0..{sel.size - 1}")
            docs.append({"input_ids": ids[r, sel], "loss_mask": mask[r, sel]})
    return docs
