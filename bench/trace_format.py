"""Bytes per component-step and writer time of the trace's Parquet options, on a recorded GPT.

Records the overhead benchmark's GPT (4 layers, d=256, seq 128; every component, every step) for
`--steps` steps, or takes `--trace`, then writes its health rows again in 100-step segments (as
the recorder does at its default flush) with the options of earlier versions and the current
`schema.PARQUET_WRITE_OPTIONS`, and prints bytes per component-step and milliseconds per segment
(the writer thread's cost; the training thread never writes). Every variant is read back and
compared with the rows, so no option loses a value. The last line is what the recorder writes by
default: the current options on the rows with their estimate columns rounded to
`schema.SAMPLED_BITS` significand bits (the recording is made with `full_precision=True`, so the
lines above it see every bit; a `--trace` recorded with the default is rounded already).

Run: `python bench/trace_format.py [--steps 200] [--trace DIR]`.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from warninglight.tracer import schema
from warninglight.tracer.writer import rounded_table

SEGMENT_STEPS = 100

VARIANTS: dict[str, dict[str, object]] = {
    "snappy (format 1)": {"compression": "snappy"},
    "zstd, defaults": {"compression": "zstd"},
    "zstd, dictionary on names only": {"compression": "zstd", "use_dictionary": ["component"]},
    "zstd level 9 + current encodings": {**schema.PARQUET_WRITE_OPTIONS, "compression_level": 9},
    "current (schema.PARQUET_WRITE_OPTIONS)": dict(schema.PARQUET_WRITE_OPTIONS),
}


def record(out: Path, steps: int) -> Path:
    """Train the overhead benchmark's GPT for `steps` steps under the recorder."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cases import gpt_case
    from warninglight.tracer import watch

    torch.manual_seed(0)
    model, loss_fn = gpt_case(16, n_layer=4, n_embd=256, block=128)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    with watch(model, opt, out, flush_every_steps=SEGMENT_STEPS, flush_every_s=1e9, full_precision=True) as rec:
        for _ in range(steps):
            loss = loss_fn()
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.log(loss=loss)
    return out


def segments(trace: Path) -> list[pa.Table]:
    """The trace's health rows cut into 100-step segments, rows in the order the writer writes."""
    files = sorted((trace / "health").rglob("*.parquet"))
    rows = pa.concat_tables([pq.read_table(f).select(schema.SCHEMAS["health"].names) for f in files])
    rows = rows.cast(schema.SCHEMAS["health"])
    first, last = pc.min(rows["step"]).as_py(), pc.max(rows["step"]).as_py()
    out = []
    for start in range(first, last + 1, SEGMENT_STEPS):
        part = rows.filter(pc.and_(pc.greater_equal(rows["step"], start),
                                   pc.less(rows["step"], start + SEGMENT_STEPS)))
        if len(pc.unique(part["step"])) == SEGMENT_STEPS:
            out.append(part)  # full segments only: a short tail would overstate the footer's share
    return out


def measure(parts: list[pa.Table], options: dict[str, object], repeats: int = 3) -> tuple[float, float]:
    """(bytes per row, ms per segment) of writing `parts` with `options`; checks the read-back."""
    size, best = 0, float("inf")
    for _ in range(repeats):
        size, start = 0, time.perf_counter()
        for part in parts:
            buf = io.BytesIO()
            pq.write_table(part, buf, **options)
            size += buf.tell()
        best = min(best, time.perf_counter() - start)
    for part in parts:
        buf = io.BytesIO()
        pq.write_table(part, buf, **options)
        assert pq.read_table(io.BytesIO(buf.getvalue())).cast(part.schema).equals(part), options
    rows = sum(p.num_rows for p in parts)
    return size / rows, 1000 * best / len(parts)


def column_bytes(parts: list[pa.Table], options: dict[str, object]) -> dict[str, float]:
    """Compressed bytes per component-step of each column (the files' own metadata)."""
    sizes: dict[str, int] = {}
    for part in parts:
        buf = io.BytesIO()
        pq.write_table(part, buf, **options)
        meta = pq.ParquetFile(io.BytesIO(buf.getvalue())).metadata
        for g in range(meta.num_row_groups):
            for c in range(meta.num_columns):
                col = meta.row_group(g).column(c)
                sizes[col.path_in_schema] = sizes.get(col.path_in_schema, 0) + col.total_compressed_size
    rows = sum(p.num_rows for p in parts)
    return {name: size / rows for name, size in sizes.items()}


def print_estimates(label: str, parts: list[pa.Table]) -> None:
    """The estimate columns' share of the bytes, each and in all."""
    per = column_bytes(parts, dict(schema.PARQUET_WRITE_OPTIONS))
    names = [c.name for c in schema.HEALTH_COLUMNS if c.bits is not None]
    each = ", ".join(f"{n} {per[n]:.2f}" for n in sorted(names, key=lambda n: -per[n]))
    print(f"    {label}: estimate columns {sum(per[n] for n in names):.2f} of {sum(per.values()):.2f} B ({each})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--trace", type=Path, default=None, help="a recorded trace instead of recording one")
    args = parser.parse_args()
    trace = args.trace or record(Path(tempfile.mkdtemp(prefix="wl-format-")) / "gpt", args.steps)
    parts = segments(trace)
    if not parts:
        sys.exit(f"{trace} holds no full {SEGMENT_STEPS}-step segment; record more steps")
    per_step = parts[0].num_rows // SEGMENT_STEPS
    print(f"{trace}: {len(parts)} segments of {SEGMENT_STEPS} steps x {per_step} components")
    for name, options in VARIANTS.items():
        per_row, ms = measure(parts, options)
        print(f"  {name:40s} {per_row:6.2f} B per component-step  {ms:6.1f} ms per segment written")
    print_estimates("every bit", parts)
    start = time.perf_counter()
    parts = [rounded_table(p) for p in parts]
    round_ms = 1000 * (time.perf_counter() - start) / len(parts)
    per_row, ms = measure(parts, dict(schema.PARQUET_WRITE_OPTIONS))
    print(f"  {'current, estimates to ' + str(schema.SAMPLED_BITS) + ' bits (default)':40s} "
          f"{per_row:6.2f} B per component-step  {ms:6.1f} ms per segment written "
          f"(+{round_ms:.1f} ms rounding, here on Arrow columns)")
    print_estimates("rounded", parts)


if __name__ == "__main__":
    main()
