"""Past one machine: a multi-rank trace is plain hive-partitioned Parquet that other engines read as is."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow.dataset as ds
import pytest
import torch
from warninglight.forensics import open_trace
from warninglight.tracer import watch


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks of one run, each a real (tiny) training loop writing its own partition."""
    root = tmp_path_factory.mktemp("fleet") / "run"
    for rank in (0, 1):
        torch.manual_seed(rank)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1))
        x, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
        with watch(model, opt, root, rank=rank, world_size=2, flush_every_steps=5) as rec:
            for _ in range(12):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
                rec.log(loss=loss)
    return root


QUESTION = ("SELECT rank, component, max(grad_norm_l2) AS worst FROM health "
            "WHERE grad_norm_l2 IS NOT NULL GROUP BY rank, component ORDER BY rank, component")


def _engine_answer(root: Path) -> pl.DataFrame:
    t = open_trace(root)
    try:
        return pl.from_arrow(t.sql(QUESTION).to_arrow_table())  # type: ignore[return-value]
    finally:
        t.close()


def test_polars_scan_parquet_reads_the_ranks_from_the_paths(two_ranks: Path) -> None:
    health = pl.scan_parquet(two_ranks / "health" / "**" / "*.parquet", hive_partitioning=True)
    answer = (health.filter(pl.col("grad_norm_l2").is_not_null())
              .group_by("rank", "component").agg(pl.col("grad_norm_l2").max().alias("worst"))
              .sort("rank", "component").collect())
    assert sorted(answer["rank"].unique().to_list()) == [0, 1]
    assert len(answer) == 4  # two Linear layers on each rank
    expected = _engine_answer(two_ranks)
    assert answer.cast({"rank": pl.Int64, "worst": pl.Float64}).equals(
        expected.cast({"rank": pl.Int64, "worst": pl.Float64}))


def test_pyarrow_dataset_prunes_by_the_hive_partitions(two_ranks: Path) -> None:
    dataset = ds.dataset(two_ranks / "health", format="parquet", partitioning="hive")
    assert {"rank", "incarnation"} <= set(dataset.schema.names)
    rank1 = dataset.to_table(filter=ds.field("rank") == 1)
    assert set(rank1.column("rank").to_pylist()) == {1}
    assert rank1.num_rows == 12 * 3  # 12 steps, 3 components (two Linear, one ReLU)
    # only rank 1's files are opened for that question
    opened = [frag.path for frag in dataset.get_fragments(filter=ds.field("rank") == 1)]
    assert opened and all("/rank=1/" in path for path in opened)
    assert len(opened) < len(list(dataset.get_fragments()))
