"""Render docs/trace-format.md from the schema, so the document cannot drift from the code.

Run `python -m warninglight.lab.formatdoc > docs/trace-format.md`; a test checks they agree.
"""

from __future__ import annotations

import textwrap

import pyarrow as pa
from warninglight.tracer import schema

MANIFEST_DOCS: dict[str, str] = {
    "format_version": f"trace format version (this document: {schema.FORMAT_VERSION})",
    "run_id": "identifier of the run; kept when a later incarnation reuses the directory",
    "rank": "this file's rank (the manifest is per rank)",
    "world_size": "number of ranks in the run (torch.distributed world size, else 1)",
    "started_at": "when the first incarnation started, seconds since the Unix epoch",
    "model_class": "class name of the recorded model",
    "host": "name of the machine this rank ran on (`platform.node()`); absent in traces written before it",
    "versions": "versions of python, torch and warninglight that wrote the latest incarnation",
    "config": "recorder settings (sample_size, sketch_size, flush_every_steps, flush_every_s, "
              "heads, start_step, hooks_under_compile, replicas, significand_bits: the `health` "
              "columns stored rounded and the significand bits kept of each, `{}` under "
              "`full_precision=True`; absent in traces written before it) and any extra keywords "
              "given to `watch`",
    "incarnations": "one entry per process that recorded into this directory (keys below)",
}

INCARNATION_DOCS: dict[str, str] = {
    "incarnation": "1, 2, ...: the `incarnation=N` partition this process wrote",
    "started_at": "seconds since the Unix epoch",
    "ended_at": "seconds since the Unix epoch; null while running or after a kill",
    "status": "`running` (or killed: SIGKILL leaves it so), `normal`, `sigterm`, `exception`",
    "first_step": "first step written by this incarnation",
    "last_step": "last step written (in a closed segment)",
    "steps_recorded": "steps written in closed segments",
    "dropped_steps": "steps lost to write failures, a writer that fell behind, or probe errors",
    "segments": "segments committed (one Parquet file per table each, and one commit record)",
    "flush_wait_s": "seconds the training thread waited, in total, for the previous segment to be "
                    "committed before handing over the next (normally 0)",
    "warnings": "the first write or probe errors, as text",
}

_NOTES = """\
## How the numbers are measured

- **Kinds.** Each `health` metric says what it measures: `forward` (the component's forward
  output), `head` (the softmax of an output head), `gradient` (its parameter gradients at
  `optimizer.step()`), `weights` (its parameters and their change across the step); `count`
  marks counts of values that are 0 when all is well. `schema.metrics_of(kind)` lists them.
- **Steps.** A step ends at `optimizer.step()` (or `rec.step()` when no optimizer is given) and
  is counted from 1 (`watch(..., start_step=N)` continues from N when resuming). `rec.log` and
  `rec.batch` belong to the step in progress if a training forward ran since the last step, else
  to the step just completed; `rec.checkpoint` records the steps completed so far.
- **torch.compile.** By default (`hooks_under_compile="graph"`) the forward hooks run inside
  compiled graphs (no graph break, `fullgraph=True` works, a model compiled whole or block by
  block); `"eager"` runs them outside the graph (one graph break per component); `"skip"`
  records no forward statistics in compiled code, and a `warning` event names the components
  not seen. Gradient and weight metrics work in every mode; a model compiled whole has a
  pre-clip total from its third step.
- **Ranks.** With a world size above 1 every rank writes the `replicas` table: exact weight
  checksums of every component after every step (compare ranks: bit-identical replicas have
  equal checksums, so replicas that part are found at the step they part), the same checksum at
  the forward (which rank's weights were written outside the optimizer: on every component
  whose parameters PyTorch saw written, and on every component at least every 8 steps, for the
  writes it does not see) and, when the watched
  model is the `DistributedDataParallel` wrapper, the local gradient norm each rank contributed
  before the all-reduce (read in a DDP communication hook that then performs DDP's own
  arithmetic, so training stays bit-identical; if the model already has a communication hook,
  local norms are not recorded and a `warning` event says so). `warninglight query TRACE
  "select * from ranks"` shows the ranks side by side.
- **Sharded parameters (FSDP2 `fully_shard`).** Every weight and gradient metric of a sharded
  parameter is computed on this rank's shard (per shard, the rank is the partition): the full
  parameter's L2 norm is `sqrt(sum(norm^2))` over the ranks' rows of a step; `update_ratio` and
  the sketch-based metrics are per shard. `replicas.sharded` is true and checksums are not
  compared across ranks.
- **Training forwards only.** Hooks record only when the module is in training mode and
  gradients are enabled: `model.eval()` and `torch.no_grad()` passes are not part of any step.
  A forward pass of the watched model under no_grad runs with the components' hooks out of their
  modules (a module with a hook, even one that returns at once, is called through torch's
  slower path), but for a module that also has hooks of other owners; a forward that turns
  gradients back on inside such a pass is not observed.
- **Subsample.** `out_*` statistics (except `out_nonfinite_count`) come from the *first* training
  forward of the step (the first micro-batch under gradient accumulation), on up to
  `sample_size` (default 16) evenly strided rows of the output viewed as (rows, units): units
  are the last dimension, or the channel dimension for convolution/batch-norm outputs and 4-D
  or 5-D outputs (of which at most 8 images are sampled). Very wide outputs get fewer rows: at
  most 65536 values per component, never fewer than 4 rows.
- **Non-finite counts** cover the whole output of every micro-batch. On an accelerator every
  output is counted. On CPU (a full pass over every output costs more than the rest of the
  recorder) a forward pass whose own output (the model's first output tensor) is finite lets
  its components' outputs go uncounted at its end; once one of a step's forward passes has a
  non-finite output, its outputs and those of the step's later micro-batches are held until
  the gradients exist and counted (if they are not all finite, or if the model's output was
  seen not finite: masked logits hold -inf with finite gradients). So a NaN/Inf that reaches
  the model's output is counted exactly in every component; one that reaches neither the
  gradients nor the model's output is not counted; and when the gradients are not
  finite while a forward pass of the step let its outputs go (a NaN that starts in the loss or
  the backward pass, or an overflow masked out of the output whose backward makes NaN), the
  step's `out_nonfinite_count` is **null** in every component — unknown, never a false or
  partial count. Without the compiled kernels, for a model output that is not a contiguous
  float32 tensor, or one over a third of the values held, the model's output is not checked:
  the outputs are held to the step and counted if the gradients are not all finite. A held
  output is counted as it stands when counted: where a later in-place op wrote it (an
  `nn.ReLU(inplace=True)` after a layer turns -inf into 0), the layer's count misses the values
  that op made finite; the in-place op's own component counts its output exactly.
- **Gradients** are read in `optimizer.step()`'s pre-hook, after `GradScaler.step` unscaled
  them, and summed over micro-batches as PyTorch accumulates them.
- **Sketch.** Update norm, ratio and cosine use a fixed random set of up to `sketch_size`
  (default 256) coordinates per parameter tensor (all of them for smaller tensors), drawn from
  the recorder's own generator; squared differences are scaled by numel/k to estimate the full
  norm. **Weight drift** is the larger of the sketch estimate and the change of the exact weight
  norm between the end of the previous step and the first forward of this one, so a rescaled
  layer or a large change of one element outside the sketch is seen; a sign flip of one
  element outside the sketch is not.
- **Heads** (`role = head`): the components named in `watch(heads=[...])`, else the last
  component called in the first forward that owns parameters or whose parameters are all tied
  to a module listed before it. Entropy and max probability are of the softmax over the last
  dimension of the sampled rows. An output head tied to the token embedding (`lm_head.weight =
  wte.weight`: nanoGPT, GPT-2, models with `tie_word_embeddings`) is such a module: it is the
  head, with its output and prediction columns, and `tied_to` names the embedding; it owns no
  parameter (`param_count` 0), so its parameter columns are null and the shared weight's norms,
  gradients and updates are on the embedding's rows alone, counted once. A tied module that is
  not a head is not recorded: no component when heads are named, else listed with null health
  rows.
- **Precision.** The columns marked "an estimate" are statistics of a subsample (`out_*`,
  `pred_*`) or of a coordinate sketch (`update_*`). The recorder stores them rounded to nearest
  (ties to even) to 10 significand bits after the leading one, so a stored value is within
  2^-11 (0.05%) of the computed one (NaN, ±inf, ±0 and exact powers of two unchanged; a finite
  value never rounds to infinity; a subnormal may round to 0). Their sampling error is 0.4% or
  more (at most 65,536 values per subsample, 256 coordinates per sketch), and the engine's
  robust scale is at least 2% of the median, so the low bits carried noise and no verdict:
  stored whole they took ~18 of the ~24 bytes per component-step of the bench GPT, rounded ~9.6
  of ~15.6 (`bench/trace_format.py`). Norms of whole tensors, counts, fractions and weight drift
  keep every bit. `watch(..., full_precision=True)` stores every bit of every column; the
  manifest's `config.significand_bits` says which a trace holds. Traces written before this are
  read as they are.
- **Nulls** mean "not applicable": parameter metrics for activations, saturation for unbounded
  components, prediction metrics for non-heads, update cosine and drift on an incarnation's
  first step and on the first step after steps whose parameter statistics the recorder lost (a
  fault of its own, reported as a `warning` event), output metrics for a component not called in a
  step. NaN means the value itself
  was not finite (or undefined: `update_cos` when either update is exactly zero).

## Durability

Every `flush_every_steps` steps (default 100) or `flush_every_s` seconds (default 30) the
finished steps are handed to a background thread as one segment; the first segment of a run
closes early, after min(10, `flush_every_steps`) steps or min(5 s, `flush_every_s`), so that a run
killed in its first seconds still leaves a readable trace. For every table the writer writes
`part-NNNNNN-sA-B.parquet.tmp` and renames it when complete; when all the segment's tables are in
place it writes the segment's commit record `commits/rank=R/incarnation=I/part-NNNNNN-sA-B.json`
(to a temporary name, then renamed), then the manifest. Readers of a version-2 trace use only
committed segments, and name in a warning any segment file without a commit record (a kill
between two renames): a segment's `steps` rows never appear without its `health` rows.
Plain DuckDB or Polars globbing `health/rank=*/incarnation=*/*.parquet` sees every renamed file,
committed or not; filter on the names under `commits/` for the same guarantee.

One segment is written at a time: a flush that finds the previous segment still being written
waits for it (normally not at all; `flush_wait_s` in the manifest sums the waits), at most 2 s,
and past that drops the new segment's steps and counts them rather than hold unwritten steps in
memory. A SIGKILL therefore loses the open segment and at most the one segment being written;
`close()`, leaving the `with` block, SIGTERM (the handler chains to any previous one, then the
default action ends the process; one that arrives while the recorder ends a step or flushes
closes it once that is done) and interpreter exit flush everything. `close()` called from
another thread (a watchdog) waits for whatever the recorder is doing on the training thread (a
hook, a step's end, a flush), and that thread's later steps go unrecorded; a SIGTERM meanwhile
ends the process once that close is done. A KeyboardInterrupt raised
inside the recorder leaves the values it had not filled null, never another step's. Any write
error drops that segment's steps, counts them in `dropped_steps` and warns once (a manifest
that fails to follow a committed segment drops none); training is never interrupted.
Temporary files left by a kill are not segments and readers ignore them.
"""


def _type_name(t: pa.DataType) -> str:
    return {"float": "float32", "double": "float64"}.get(str(t), str(t))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a literal | would end the table cell


def _kind(c: schema.Column) -> str:
    return "" if not c.kind else c.kind + (", count" if c.count else "")


def _meaning(c: schema.Column) -> str:
    return _cell(c.doc) + (f" (an estimate: stored to {c.bits} significand bits, see Precision)"
                           if c.bits is not None else "")


def _table(columns: tuple[schema.Column, ...]) -> list[str]:
    if not any(c.kind for c in columns):
        lines = ["| column | type | unit | meaning |", "|---|---|---|---|"]
        return lines + [f"| `{c.name}` | {_type_name(c.type)} | {_cell(c.unit)} | {_cell(c.doc)} |"
                        for c in columns]
    lines = ["| column | type | unit | kind | meaning |", "|---|---|---|---|---|"]
    return lines + [f"| `{c.name}` | {_type_name(c.type)} | {_cell(c.unit)} | {_kind(c)} | {_meaning(c)} |"
                    for c in columns]


def _layout() -> list[str]:
    """The directory sketch from schema.py's docstring, dedented."""
    block = (schema.__doc__ or "").split("::")[1].split("`rank`")[0].strip("\n")
    return textwrap.dedent(block).splitlines()


def render() -> str:
    """The whole of docs/trace-format.md."""
    out = [f"# Trace format v{schema.FORMAT_VERSION}", "",
           "Generated from `tracer/schema.py` by `python -m warninglight.lab.formatdoc`; "
           "do not edit by hand.", "", "```text", *_layout(), "```", "",
           "`rank` and `incarnation` are hive partitions (directory names), read as columns by "
           "DuckDB `read_parquet(..., hive_partitioning=true)` and Polars `hive_partitioning=True`. "
           "Steps that repeat after a restart from a checkpoint are kept; `incarnation` tells them apart. "
           "A process takes the next incarnation by making its folder under `commits/`, so two "
           "processes that start on one directory at once take different ones; each rewrites the "
           "manifest under a lock (`manifest/rank=R.lock`, a POSIX record lock that a forked child "
           "does not keep, waited for at most a second), keeping the other's entry as it stands on disk.",
           ""]
    for table in schema.TABLES:
        out += [f"## `{table}`", "", *_table(schema.COLUMNS[table]), ""]
    out += ["## Manifest (`manifest/rank=R.json`)", "", "| key | meaning |", "|---|---|"]
    out += [f"| `{k}` | {MANIFEST_DOCS[k]} |" for k in schema.MANIFEST_KEYS]
    out += ["", "Each entry of `incarnations`:", "", "| key | meaning |", "|---|---|"]
    out += [f"| `{k}` | {INCARNATION_DOCS[k]} |" for k in schema.INCARNATION_KEYS]
    out += ["", f"Event kinds: {', '.join(f'`{k}`' for k in schema.EVENT_KINDS)}.", "", _NOTES]
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
