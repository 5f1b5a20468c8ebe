"""The trace format: every file, table, column, type and unit. Writer and reader both ask here.

A trace is a directory::

    TRACE/
      manifest/rank=0.json                                    one per rank, rewritten atomically
      components/rank=0/incarnation=1/part-000000-s1-10.parquet   one row per component
      health/rank=0/incarnation=1/part-000000-s1-10.parquet       one row per (step, component)
      steps/rank=0/incarnation=1/part-000000-s1-10.parquet        one row per optimizer step
      scalars/rank=0/incarnation=1/part-000000-s1-10.parquet      one row per (step, logged name)
      events/rank=0/incarnation=1/part-000000-s1-10.parquet       start, stop, checkpoint, ...
      replicas/rank=0/incarnation=1/part-000000-s1-10.parquet     per-rank evidence (world size > 1)

      commits/rank=0/incarnation=1/part-000000-s1-10.json       commit record, written last

`rank` and `incarnation` are hive partitions: they live in the path, not in the files, and
DuckDB (`hive_partitioning=true`) and Polars (`hive_partitioning=True`) turn them into columns.
Each table's file of a segment is written complete under a temporary name and then renamed, so
a reader never sees a half-written Parquet file. A segment becomes visible as one unit: after all
its files are in place the writer writes its commit record (`commits/`, named like the segment,
holding the rows written per table), atomically. Readers of a version-2 trace use only segments
that have a commit record and name the files they ignore; a killed process therefore leaves
either all of a segment's tables or none of them (version-1 traces have no commit records and
are read file by file). A segment's file name carries its number and the first and last optimizer step it holds
(`-s<first>-<last>`), so a reader can pick the files of a step window without opening any; a
segment that holds no step (a run closed before its first step) has no step range in its name,
and neither do the segments of format version 1.

Steps count optimizer steps from 1: the row of step s describes the s-th optimizer step (its
forward/backward passes, its gradients, its update). A checkpoint recorded at step s holds the
weights after s steps, so it is free of a fault whose onset is at step s + 1 or later.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pyarrow as pa

FORMAT_VERSION = 2
SUPPORTED_FORMAT_VERSIONS = frozenset({1, 2})

MANIFEST_DIR = "manifest"
COMMIT_DIR = "commits"
COMMIT_SUFFIX = ".json"
TABLES = ("components", "health", "steps", "scalars", "events", "replicas")
SEGMENT_SUFFIX = ".parquet"
TMP_SUFFIX = ".tmp"
_SEGMENT_NAME = re.compile(r"^part-(\d{6,})(?:-s(\d+)-(\d+))?\.parquet$")



# What a health metric measures, by where its value comes from. Recorder and engine both ask
# `metrics_of` / `kind_of` instead of keeping their own lists.
FORWARD = "forward"    # a component's forward output (forward hook)
HEAD = "head"          # the softmax of an output head's forward output
GRADIENT = "gradient"  # the component's parameter gradients at optimizer.step
WEIGHTS = "weights"    # the component's parameters and their change across the step
METRIC_KINDS = (FORWARD, HEAD, GRADIENT, WEIGHTS)


@dataclass(frozen=True)
class Column:
    """One column of a trace table: its name, Arrow type, unit and meaning.

    Health metrics also say what they measure (`kind`, one of METRIC_KINDS), whether they
    are a `count` of values (an integer that is 0 when all is well, e.g. non-finite values)
    rather than a measured value, and for an estimate from a subsample or a sketch, the
    significand `bits` the recorder stores of it by default (see `SAMPLED_BITS`).
    """

    name: str
    type_name: str  # the Arrow type as pyarrow prints it (F32, F64, ...)
    unit: str
    doc: str
    kind: str = ""
    count: bool = False
    bits: int | None = None  # significand bits stored after the leading one; None: all of them

    @property
    def type(self) -> pa.DataType:
        """The Arrow type (imports pyarrow, which only writers and readers of Parquet need)."""
        return _arrow_type(self.type_name)

    @property
    def floating(self) -> bool:
        return self.type_name in (F32, F64)


# Arrow type names: this module reads without importing pyarrow (a slow import, with numpy),
# which the engine's quick commands (`info`, `query`) never load; `Column.type` builds the Arrow
# type.
F32, F64, I64, STR, BOOL = "float", "double", "int64", "string", "bool"
LIST_F64, LIST_I64, LIST_STR = "list<item: double>", "list<item: int64>", "list<item: string>"
LIST_BOOL = "list<item: bool>"


def _arrow_type(name: str) -> pa.DataType:
    import pyarrow as pa

    return {F32: pa.float32, F64: pa.float64, I64: pa.int64, STR: pa.string, BOOL: pa.bool_,
            LIST_F64: lambda: pa.list_(pa.float64()), LIST_I64: lambda: pa.list_(pa.int64()),
            LIST_STR: lambda: pa.list_(pa.string()), LIST_BOOL: lambda: pa.list_(pa.bool_())}[name]()


def _schema(columns: tuple[Column, ...]) -> pa.Schema:
    import pyarrow as pa

    return pa.schema([pa.field(c.name, c.type, nullable=True) for c in columns])


COMPONENT_COLUMNS: tuple[Column, ...] = (
    Column("component", STR, "", "module path from `named_modules()`, e.g. `h.2.attn.c_attn`; `` is the root"),
    Column("kind", STR, "", "module class name, e.g. `Linear`, `ReLU`"),
    Column("forward_index", I64, "", "order of first call in the first recorded forward pass (0 = first); null if never called"),
    Column("param_count", I64, "parameters", "parameters owned directly by this module (not its children)"),
    Column("role", STR, "", "`param` (owns parameters, or a tied module not chosen as a head: see `tied_to`), `activation` (parameter-free nonlinearity) or `head` (output head)"),
    Column("bound", STR, "", "range of a bounded activation: `tanh` (-1,1), `sigmoid` (0,1), `relu` [0,inf), or null"),
    Column("parent_param", STR, "", "for an activation: the parameter-owning component called just before it (the layer it reads from)"),
    Column("param_group", I64, "", "index of the optimizer param group holding this component's parameters (the first that holds any); null if it owns none or the optimizer holds none of them"),
    Column("param_names", LIST_STR, "", "the names (`model.named_parameters()`, i.e. state-dict keys) of the parameters this module owns directly, in its own order; null if it owns none"),
    Column("optimizer_index", LIST_I64, "", "each of those parameters' index in the optimizer's parameter order at the first step (param groups in order, each group's `params` in order): the key of `optimizer.state_dict()[\"state\"]`; null entries for parameters the optimizer does not hold. `warninglight repair` matches optimizer state to parameters through it"),
    Column("requires_grad", LIST_BOOL, "", "each of those parameters' `requires_grad` at the first step, in the same order; null if it owns none"),
    Column("tied_to", STR, "", "for a module whose parameters are all tied to (shared with) a module listed before it, e.g. an output head tied to the token embedding: that owner's path. It owns none (`param_count` 0, parameter columns null): the shared parameters' statistics are the owner's rows alone. Such a module is recorded only as a head (see Heads); when no heads are named and it is not chosen, it is listed with null health rows. Null for every other module, and in traces written before it"),
)

# Significand bits kept of an estimate (a statistic of a 16-row subsample of an output, or of a
# 256-coordinate sketch of a parameter): rounded to nearest, a value moves by at most 2**-11 of
# itself (0.05%), against a sampling error of 0.4% and more (a subsample holds at most 65,536
# values: 1/sqrt(65536)) and a baseline scale of at least 2% (`REL_FLOOR` in
# forensics/judging/baseline.py, `LOG_SCALE_FLOOR` in forensics/explaining/ranks.py). The low
# bits of such a value are sampling noise, and noise does not compress: stored whole, these 8
# columns are most of a trace's bytes; rounded, they compress (`bench/trace_format.py` prints
# both sizes).
# Exact values (norms of whole tensors, counts, fractions) keep every bit. (The update of a tensor
# of at most 256 entries is its whole sketch, so exact, and rounded all the same: 0.05% is still
# far under the 2% the engine's scale resolves.) `watch(..., full_precision=True)`
# stores every bit; a trace's manifest config says which it holds (`significand_bits`).
SAMPLED_BITS = 10

HEALTH_COLUMNS: tuple[Column, ...] = (
    Column("step", I64, "optimizer steps", "optimizer step, counted from 1"),
    Column("component", STR, "", "module path, a key of `components`"),
    Column("out_mean", F32, "activation units", "mean of the forward output (finite values of the subsample)", FORWARD, bits=SAMPLED_BITS),
    Column("out_rms", F32, "activation units", "root mean square of the forward output", FORWARD, bits=SAMPLED_BITS),
    Column("out_absmax", F32, "activation units", "largest |value| of the forward output", FORWARD, bits=SAMPLED_BITS),
    Column("out_zero_frac", F32, "fraction", "share of output values exactly 0", FORWARD),
    Column("out_sat_frac", F32, "fraction", "share of outputs within 1% of a bounded activation's bounds; null if unbounded", FORWARD),
    Column("out_dead_frac", F32, "fraction", "share of output units (last dim; channels for conv) whose |output| <= 1e-6 for every sampled row", FORWARD),
    Column("out_nonfinite_count", I64, "values", "NaN/Inf values in the whole forward output (all micro-batches)", FORWARD, count=True),
    Column("grad_norm_l2", F32, "gradient units", "L2 norm of this module's own parameter gradients at optimizer.step (unscaled)", GRADIENT),
    Column("grad_nonfinite_count", I64, "values", "NaN/Inf values in this module's parameter gradients", GRADIENT, count=True),
    Column("weight_norm_l2", F32, "weight units", "L2 norm of this module's parameters after the step", WEIGHTS),
    Column("update_norm_l2", F32, "weight units", "L2 norm of this step's parameter change, estimated from a fixed coordinate sketch (exact for small tensors)", WEIGHTS, bits=SAMPLED_BITS),
    Column("update_ratio", F32, "ratio", "update_norm_l2 / weight_norm_l2", WEIGHTS, bits=SAMPLED_BITS),
    Column("update_cos", F32, "cosine", "cosine between this step's and the previous step's update on the sketch, in [-1, 1]", WEIGHTS, bits=SAMPLED_BITS),
    Column("weight_drift_l2", F32, "weight units", "change of the weights between the end of the previous optimizer step and this step's first forward: non-zero means something other than the optimizer wrote them (from a fixed coordinate sketch every step; from exact norms when a version counter moved and every 8th step, so a write through `.data` outside the sketch shows only on those)", WEIGHTS),
    Column("pred_entropy_nats", F32, "nats", "mean entropy of the softmax over the head's last dim (heads only)", HEAD, bits=SAMPLED_BITS),
    Column("pred_maxprob", F32, "probability", "mean largest softmax probability (heads only)", HEAD, bits=SAMPLED_BITS),
)

STEP_COLUMNS: tuple[Column, ...] = (
    Column("step", I64, "optimizer steps", "optimizer step, counted from 1"),
    Column("wall_time_s", F64, "seconds since the Unix epoch", "when the optimizer step finished"),
    Column("step_time_s", F64, "seconds", "wall time since the previous step finished"),
    Column("loss", F64, "loss units", "`rec.log(loss=...)`; mean if logged several times in a step"),
    Column("lr", F64, "learning rate", "learning rate of the optimizer's first param group"),
    Column("lr_groups", LIST_F64, "learning rate", "learning rate of every param group, in the optimizer's order (`components.param_group` indexes it)"),
    Column("grad_norm_total_l2", F64, "gradient units", "L2 norm of all parameter gradients together as optimizer.step receives them: after any clipping or unscaling the training loop did (the per-component `grad_norm_l2` are taken at the same point)"),
    Column("grad_norm_preclip_l2", F64, "gradient units", "L2 norm of all parameter gradients as the step's last backward pass left them, before clipping (what `clip_grad_norm_` sees; with a GradScaler, the scaled norm); null on the first step whose gradients the loop modified after backward, on a step of fewer backward passes (micro-batches) than the steps before it, where no backward pass was seen, and on a step whose change after backward, on a loop seen to only rescale its gradients, was no single factor or more than one write to a gradient (docs/overhead.md, \"Gradient norms and clipping\"; on such a loop the value is the total over that factor, float32 roundings from a pass of its own)"),
    Column("micro_batches", I64, "forward passes", "training forward passes of the root module in this step"),
    Column("batch_ids", LIST_I64, "sample ids", "`rec.batch(ids)`: the samples (or batch indices) this step consumed"),
    Column("eval_forwards", I64, "forward passes", "forward passes of the watched model in eval() mode with gradients enabled in this step (0 when it trains in train() mode)"),
    Column("grads_not_cleared", I64, "parameters", "parameters held by the optimizer whose gradient at this optimizer step still held the previous step's: never set to None or zeroed in between, as seen at the start of each backward pass through the model's output (a missing `zero_grad()`); null on the first step and where no such backward pass was seen"),
    Column("params_with_grad", I64, "parameters", "parameters held by the optimizer that had a gradient at optimizer.step (0: the step changed nothing)"),
    Column("input_rows", I64, "rows", "rows (size of dim 0) of the first tensor the watched model's forward received, summed over the step's forwards with gradients enabled; null if none"),
    Column("input_shape", LIST_I64, "", "the shape of that tensor at the step's first such forward"),
)

SCALAR_COLUMNS: tuple[Column, ...] = (
    Column("step", I64, "optimizer steps", "optimizer step, counted from 1"),
    Column("name", STR, "", "name given to `rec.log(name=value)` (other than `loss`)"),
    Column("value", F64, "as logged", "mean of the values logged under that name in that step"),
)

EVENT_KINDS = ("start", "stop", "checkpoint", "restart", "warning", "dropped", "finding")
EVENT_COLUMNS: tuple[Column, ...] = (
    Column("step", I64, "optimizer steps", "steps completed when the event happened"),
    Column("wall_time_s", F64, "seconds since the Unix epoch", "when it happened"),
    Column("kind", STR, "", "one of: " + ", ".join(EVENT_KINDS)),
    Column("path", STR, "", "checkpoint file, for `checkpoint` events"),
    Column("detail", STR, "", "free text or JSON: warnings, reason for stop, counts of dropped steps"),
)

REPLICA_COLUMNS: tuple[Column, ...] = (
    Column("step", I64, "optimizer steps", "optimizer step, counted from 1"),
    Column("component", STR, "", "module path of a parameter-owning component"),
    Column("weight_checksum", I64, "", "checksum of this rank's copy of the component's parameters after the step: per parameter, the mod-2^32 sum of its raw bits (floats viewed as 16/32-bit integer words, unsigned), summed: equal on bit-identical replicas, different after one flipped bit"),
    Column("weight_checksum_fwd", I64, "", "the same checksum at the step's first training forward; differs from the previous step's `weight_checksum` on this rank exactly when something other than the optimizer wrote the weights in between. Taken where such a write may have happened: on a component whose parameters PyTorch saw written since the last step's end (a version counter moved, a tensor replaced), and on every component in turn, at least every 8 steps (writes into `.data` and memory faults move no counter); null where not taken, or if no training forward ran"),
    Column("local_grad_norm_l2", F32, "gradient units", "L2 norm of the gradient this rank contributed before DDP's all-reduce averaged it (its last all-reduce of the step); null when not all-reduced"),
    Column("grad_allreduced", BOOL, "", "DDP all-reduced this component's gradients in this step; false on every component: the step trained outside DDP"),
    Column("sharded", BOOL, "", "the parameters are sharded across ranks (FSDP2 DTensor): checksum and norms cover this rank's shard only, and replicas are not compared"),
)

COLUMNS: dict[str, tuple[Column, ...]] = {
    "components": COMPONENT_COLUMNS,
    "health": HEALTH_COLUMNS,
    "steps": STEP_COLUMNS,
    "scalars": SCALAR_COLUMNS,
    "events": EVENT_COLUMNS,
    "replicas": REPLICA_COLUMNS,
}

# Keyword arguments of `pyarrow.parquet.write_table` for every segment the recorder writes.
# Measured on recorded GPT health segments (docs/scale.md): floats as byte stream split (the
# exponent bytes of a slowly moving norm compress; the mantissas do not), integers delta-packed,
# a dictionary only for repeated names (a dictionary of float values is larger than the values),
# statistics only on the keys (the footer otherwise grows with every row of a segment). Any
# Parquet reader reads these encodings; traces written before read as they were.
_DICTIONARY = ("component", "kind", "role", "bound", "parent_param", "name")
PARQUET_WRITE_OPTIONS: dict[str, object] = {
    "compression": "zstd",
    "use_dictionary": list(_DICTIONARY),
    "column_encoding": {
        c.name: "BYTE_STREAM_SPLIT" if c.floating else "DELTA_BINARY_PACKED"
        for cols in COLUMNS.values() for c in cols if c.floating or c.type_name == I64},
    "write_statistics": ["step", "component"],
}

# Metric columns of `health`: everything but the keys, in table order.
HEALTH_METRICS: tuple[str, ...] = tuple(c.name for c in HEALTH_COLUMNS if c.kind)
_METRIC_COLUMNS: dict[str, Column] = {c.name: c for c in HEALTH_COLUMNS if c.kind}


def metrics_of(*kinds: str, count: bool | None = None) -> tuple[str, ...]:
    """The health metrics of the given kinds (all kinds if none), in table order.

    `count=True` keeps only counts, `count=False` only measured values, None both.
    """
    unknown = set(kinds) - set(METRIC_KINDS)
    if unknown:
        raise ValueError(f"unknown metric kind {sorted(unknown)[0]!r}; expected one of {', '.join(METRIC_KINDS)}")
    wanted = kinds or METRIC_KINDS
    return tuple(c.name for c in _METRIC_COLUMNS.values()
                 if c.kind in wanted and (count is None or c.count == count))


def kind_of(metric: str) -> str:
    """What a health metric measures: one of METRIC_KINDS."""
    try:
        return _METRIC_COLUMNS[metric].kind
    except KeyError:
        raise ValueError(f"{metric!r} is not a health metric; expected one of {', '.join(HEALTH_METRICS)}") from None


def is_count(metric: str) -> bool:
    """True for a metric that counts values (0 when all is well), e.g. non-finite values."""
    kind_of(metric)  # raises for an unknown name
    return _METRIC_COLUMNS[metric].count


# Counts of non-finite values: their baseline is 0 and any count above it is the alarm.
COUNT_METRICS: tuple[str, ...] = metrics_of(count=True)

# Keys of the manifest JSON (one file per rank). Documented in docs/trace-format.md.
MANIFEST_KEYS = (
    "format_version", "run_id", "rank", "world_size", "started_at", "model_class", "host",
    "versions", "config", "incarnations",
)
# Keys of each entry of manifest["incarnations"].
INCARNATION_KEYS = (
    "incarnation", "started_at", "ended_at", "status", "first_step", "last_step",
    "steps_recorded", "dropped_steps", "segments", "flush_wait_s", "warnings",
)


def manifest_path(root: Path, rank: int) -> Path:
    """Where rank `rank` keeps its manifest."""
    return Path(root) / MANIFEST_DIR / f"rank={rank}.json"


def segment_dir(root: Path, table: str, rank: int, incarnation: int) -> Path:
    """The folder holding one table's segments for one rank and incarnation."""
    if table not in COLUMNS:
        raise ValueError(f"unknown trace table {table!r}; expected one of {', '.join(TABLES)}")
    return Path(root) / table / f"rank={rank}" / f"incarnation={incarnation}"


def segment_path(root: Path, table: str, rank: int, incarnation: int, seq: int,
                 steps: tuple[int, int] | None = None) -> Path:
    """The path of segment number `seq` (0, 1, ...) of one table; `steps` = (first, last) it holds."""
    span = "" if steps is None else f"-s{steps[0]}-{steps[1]}"
    return segment_dir(root, table, rank, incarnation) / f"part-{seq:06d}{span}{SEGMENT_SUFFIX}"


def commit_path(root: Path, rank: int, incarnation: int, seq: int,
                steps: tuple[int, int] | None = None) -> Path:
    """The commit record of segment `seq`: its presence makes every table file of the segment visible."""
    name = segment_path(root, "health", rank, incarnation, seq, steps).name
    return (Path(root) / COMMIT_DIR / f"rank={rank}" / f"incarnation={incarnation}"
            / (name.removesuffix(SEGMENT_SUFFIX) + COMMIT_SUFFIX))


def segment_glob(root: Path, table: str) -> str:
    """A glob over every closed segment of a table, for DuckDB `read_parquet` or Polars."""
    return str(Path(root) / table / "rank=*" / "incarnation=*" / f"part-*{SEGMENT_SUFFIX}")


def is_segment_name(name: str) -> bool:
    """True for a closed segment's file name (temporary files are not segments)."""
    return _SEGMENT_NAME.match(name) is not None


def segment_steps(name: str) -> tuple[int, int] | None:
    """(first, last) step a segment holds, from its file name; None if the name carries none."""
    m = _SEGMENT_NAME.match(name)
    if m is None or m.group(2) is None:
        return None
    return int(m.group(2)), int(m.group(3))


def __getattr__(name: str) -> object:
    """`SCHEMAS` (table -> Arrow schema), built on first use: it needs pyarrow."""
    if name == "SCHEMAS":
        globals()["SCHEMAS"] = {table: _schema(cols) for table, cols in COLUMNS.items()}
        return globals()["SCHEMAS"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
