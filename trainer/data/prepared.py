"""Pre-tokenized data from `speculators prepare-data`: `trainer run --set data=DIR`.

What prepare-data writes (speculators 0.9.0, `data_generation/preprocessing.py` + `datasets.save_to_disk`):
a Hugging Face `datasets` directory, `state.json` (`_data_files`: the Arrow shards, in order),
`dataset_info.json` (`features`), and `data-XXXXX-of-YYYYY.arrow` shards in Arrow's IPC stream format,
with one row per conversation: `input_ids` (list of int64), `loss_mask` (list of int64, 1 on assistant
tokens), `seq_len`. The shards are read with pyarrow (the library `datasets` itself uses), nothing else.

The rows are already tokenized with the verifier's tokenizer, so they are used as they are (no eos added,
no template applied); the target's tokenizer must be the one they were made with, which is checked as far
as it can be: every id must be inside the target's vocabulary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.data.errors import DataError
from trainer.safe_io import UnsafeFileError, loads_json, read_limited

STATE_FILE = "state.json"
INFO_FILE = "dataset_info.json"


def is_prepared_dir(path: Path) -> bool:
    return path.is_dir() and (path / STATE_FILE).is_file() and (path / INFO_FILE).is_file()


def load_prepared_rows(path: Path, vocab_size: int) -> list[tuple[list[int], list[int]]]:
    """(input_ids, loss_mask) per row, in order; DataError (one line) on anything we do not understand."""

    try:
        state = loads_json(read_limited(path / STATE_FILE, 64 * 2**20))
    except (OSError, ValueError, UnsafeFileError) as exc:
        raise DataError(f"{path / STATE_FILE}: not readable JSON ({exc})") from None
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(files, list) or not files or not all(isinstance(f, dict) and "filename" in f for f in files):
        raise DataError(f"{path / STATE_FILE}: no _data_files list (not a `datasets.save_to_disk` directory)")
    try:
        import pyarrow as pa
    except ImportError:
        raise DataError(f"{path}: reading speculators' prepared data needs pyarrow (pip install pyarrow)") from None
    rows: list[tuple[list[int], list[int]]] = []
    for entry in files:
        shard = path / str(entry["filename"])
        try:
            with pa.memory_map(str(shard)) as source:
                table = pa.ipc.open_stream(source).read_all()
        except (OSError, pa.ArrowInvalid) as exc:
            raise DataError(f"{shard}: not an Arrow stream shard ({str(exc).splitlines()[0]})") from None
        rows += _rows(table, shard, vocab_size, first_row=len(rows))
    if not rows:
        raise DataError(f"{path}: the prepared dataset has no rows")
    if not any(any(mask) for _, mask in rows):
        raise DataError(f"{path}: no token carries a loss (every loss_mask is 0)")
    return rows


def _rows(table: Any, shard: Path, vocab_size: int, first_row: int) -> list[tuple[list[int], list[int]]]:
    import pyarrow as pa


    for column in ("input_ids", "loss_mask"):
        if column not in table.column_names:
            raise DataError(
                f"{shard}: no {column!r} column (found {', '.join(table.column_names)}); speculators' prepare-data "
                "writes input_ids and loss_mask"
            )
        kind = table.schema.field(column).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(kind.value_type):
            raise DataError(f"{shard}: column {column!r} is {kind}, expected a list of integers per row")
    ids_column = table.column("input_ids").to_pylist()
    mask_column = table.column("loss_mask").to_pylist()
    rows = []
    for offset, (ids, mask) in enumerate(zip(ids_column, mask_column)):
        where = f"{shard.parent.name}/{shard.name} row {first_row + offset}"
        if ids is None or mask is None or len(ids) != len(mask):
            raise DataError(f"{where}: input_ids and loss_mask differ in length")
        if not ids:
            continue
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise DataError(
                f"{where}: token id {max(ids) if max(ids) >= vocab_size else min(ids)} is outside the target's "
                f"vocabulary of {vocab_size} (prepared with another tokenizer?)"
            )
        if any(m not in (0, 1) for m in mask):
            raise DataError(f"{where}: loss_mask holds values other than 0 and 1")
        rows.append((list(ids), list(mask)))
    return rows
