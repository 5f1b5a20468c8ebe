"""Read a W&B offline run's `.wandb` file: a LevelDB-style log of protobuf `Record`s.

The format (wandb's transaction log): a 7-byte file header, then 32 KiB blocks of chunks, each
`crc32 (4) | length (2, little-endian) | type (1)` + data; type 1 is a whole record, 2/3/4 the
first/middle/last piece of one split across blocks.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

BLOCK, HEADER, FILE_HEADER = 32 * 1024, 7, 7


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    out, pending, pos = [], b"", FILE_HEADER
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # the block's tail is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
            pending = b""
    return out
