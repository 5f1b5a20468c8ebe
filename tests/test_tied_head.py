"""An output head tied to the token embedding (`lm_head.weight = wte.weight`) is the head: its
logits carry the prediction metrics, and the shared weight is counted once, on the embedding."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from warninglight.tracer import schema, watch

VOCAB, WIDTH, STEPS = 48, 16, 6


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 2 * WIDTH)
        self.act = nn.GELU()
        self.proj = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(self.act(self.fc(self.ln(x))))


class SmallGPT(nn.Module):
    """nanoGPT's layout: token embedding, blocks, final LayerNorm, logits head (tied or not)."""

    def __init__(self, tied: bool, head_first: bool = False) -> None:
        super().__init__()
        if head_first:  # the head registered first owns the weight; the embedding is the tied one
            self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList([Block(), Block()])
        self.ln_f = nn.LayerNorm(WIDTH)
        if not head_first:
            self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied and head_first:
            self.wte.weight = self.lm_head.weight
        elif tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _train(trace: Path, tied: bool, **options: object) -> nn.Module:
    torch.manual_seed(0)
    model = SmallGPT(tied, bool(options.pop("head_first", False)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    with watch(model, opt, trace, **options):
        for _ in range(STEPS):
            idx = torch.randint(0, VOCAB, (4, 12), generator=gen)
            loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
    return model


def _read(trace: Path, table: str, sql: str) -> list[tuple]:
    t = f"read_parquet('{schema.segment_glob(trace, table)}', hive_partitioning=true)"
    return duckdb.sql(sql.replace(" from t", f" from {t}")).fetchall()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, nn.Module]]]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("tied")
    out = {}
    for name, tied, options in (("default", True, {}), ("named", True, {"heads": ["lm_head"]}),
                                ("untied", False, {})):
        out[name] = (root / name, _train(root / name, tied, **options))
    yield out
    torch.set_num_threads(before)


@pytest.mark.parametrize("run", ["default", "named"])
def test_the_tied_head_is_the_head_with_its_prediction_metrics(runs: dict, run: str) -> None:
    trace, model = runs[run]
    comps = {r[0]: r[1:] for r in _read(
        trace, "components", "select component, role, param_count, tied_to, param_names from t")}
    assert comps["lm_head"] == ("head", 0, "wte", None)
    assert comps["ln_f"][0] == "param"  # no longer taken for the head
    assert comps["wte"] == ("param", VOCAB * WIDTH, None, ["wte.weight"])
    assert [c for c, r in comps.items() if r[0] == "head"] == ["lm_head"]
    rows = _read(trace, "health", "select pred_entropy_nats, pred_maxprob, out_rms, grad_norm_l2, "
                                  "weight_norm_l2 from t where component = 'lm_head' order by step")
    assert len(rows) == STEPS
    for entropy, maxprob, out_rms, grad, weight in rows:
        assert 0 < entropy <= math.log(VOCAB) * 1.001 and 0 < maxprob <= 1 and out_rms > 0
        assert grad is None and weight is None  # the shared weight's figures are the embedding's
    # the embedding's row holds the shared weight as it ended, logits' gradient included
    last = _read(trace, "health", "select weight_norm_l2 from t where component = 'wte' "
                                  f"and step = {STEPS}")[0][0]
    assert last == pytest.approx(model.wte.weight.norm().item(), rel=1e-5)


def test_the_shared_weight_is_counted_once(runs: dict) -> None:
    sql = ("select count(weight_norm_l2), sum(param_count) filter (where weight_norm_l2 is not null)"
           " from t join read_parquet('{c}', hive_partitioning=true) using (component) "
           "where step = 1")
    counts = {}
    for name in ("default", "untied"):
        trace, model = runs[name]
        counts[name] = _read(trace, "health", sql.format(c=schema.segment_glob(trace, "components")))[0]
        assert counts[name][1] == sum(p.numel() for p in model.parameters())
    # the untied twin's head owns a weight of its own: one more owner, VOCAB * WIDTH more values
    assert counts["untied"] == (counts["default"][0] + 1, counts["default"][1] + VOCAB * WIDTH)
    trace, _ = runs["default"]  # the step's gradient norm holds the shared gradient once
    squares = dict(_read(trace, "health", "select step, sum(grad_norm_l2 * grad_norm_l2) from t "
                                          "group by step"))
    totals = dict(_read(trace, "steps", "select step, grad_norm_total_l2 from t"))
    assert sorted(totals) == sorted(squares) == list(range(1, STEPS + 1))
    for step, total in totals.items():
        assert total == pytest.approx(math.sqrt(squares[step]), rel=1e-3)
    trace, _ = runs["untied"]  # an untied model's head is still its last layer, as before
    assert _read(trace, "components", "select component from t where role = 'head'") == [("lm_head",)]


def test_a_tied_module_not_chosen_is_left_unrecorded(tmp_path: Path) -> None:
    # the head owns the weight and the embedding is tied to it: the head is the owner, and the
    # tied embedding is listed with null health rows
    _train(tmp_path / "a", True, head_first=True)
    comps = dict(_read(tmp_path / "a", "components", "select component, role from t"))
    assert comps["lm_head"] == "head" and comps["wte"] == "param"
    assert _read(tmp_path / "a", "components", "select tied_to from t where component = 'wte'") == [
        ("lm_head",)]
    assert _read(tmp_path / "a", "health", "select count(*), count(out_rms) from t "
                                            "where component = 'wte'") == [(STEPS, 0)]
    # heads named: a tied module left out of them is no component at all
    _train(tmp_path / "b", True, heads=["ln_f"])
    names = [r[0] for r in _read(tmp_path / "b", "components", "select component from t")]
    assert "ln_f" in names and "lm_head" not in names


def test_a_head_that_does_not_exist_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"heads=\['lm_haed'\] are not components") as err:
        watch(SmallGPT(True), None, tmp_path / "t", heads=["lm_haed"])
    assert "\n" not in str(err.value) and "did you mean 'lm_head'?" in str(err.value)
