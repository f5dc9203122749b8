"""Readers for what the aux peer leaves on disk, shared by the aux peer's tests."""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import List

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_valid_png(path: Path) -> None:
    """The file starts with the PNG signature and decodes into a non-empty RGB(A) image."""
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE, f"{path} is not a PNG file"
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100 and image.shape[2] in (3, 4)
    assert image.std() > 0, "the plot is blank"


def read_wandb_history(wandb_dir: Path) -> List[dict]:
    """The ``wandb.log`` rows stored in the (single) offline run under ``wandb_dir``, decoded from the run's
    ``.wandb`` file (a log of protobuf records in 32 KiB blocks, each chunk with a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    (run_file,) = Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")
    data, block_size = run_file.read_bytes(), 32 * 1024
    position, pending, rows = 7, b"", []  # the file starts with a 7-byte header (":W&B", magic, version)
    while position + 7 <= len(data):
        left_in_block = block_size - position % block_size
        if left_in_block < 7:  # block padding
            position += left_in_block
            continue
        _checksum, length, chunk_type = struct.unpack("<IHB", data[position : position + 7])
        position += 7
        if chunk_type == 0 and length == 0:  # zero-filled rest of a block
            position += left_in_block - 7
            continue
        pending += data[position : position + length]
        position += length
        if chunk_type in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows
