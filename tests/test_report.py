"""The report: figures from a real recorded run, one self-contained HTML file, the PNG folder, the CLI."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from PIL import Image
from typer.testing import CliRunner
from warninglight.cli.main import app
from warninglight.forensics.presenting import contents, plots, report, wording

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def fault_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real MLP run with one layer's weights corrupted at step 150 (200 steps, a few seconds)."""
    from warninglight.lab.rehearsal import rehearse

    trace = tmp_path_factory.mktemp("report") / "trace"
    rehearse("mlp_weight_corruption", trace, seed=0, steps=200)
    return trace


def test_html_is_self_contained_and_names_the_root(fault_trace: Path, tmp_path: Path) -> None:
    from warninglight.forensics import analyze

    out = report.write_html(fault_trace, tmp_path / "r.html")
    text = out.read_text()
    images = re.findall(r"<img alt='(\w+)' src='data:image/png;base64,([A-Za-z0-9+/=]+)'", text)
    assert [name for name, _ in images] == ["heatmap", "root_metric", "loss", "conditions"]
    assert not re.search(r"(src|href)=['\"]https?:", text)  # nothing fetched from the network
    analysis = analyze(fault_trace)
    assert wording.analysis_summary_line(analysis) in text.replace("&#x27;", "'")
    root = analysis.root
    assert root is not None and root.attributed_to == "2"  # the injected layer is the root...
    assert abs(root.onset_step - 150) <= 2
    # ...and is named in the alarm table: observed on, attributed to, condition
    assert f"<td>{root.observed_on}</td><td>2</td><td>{root.condition}</td>" in text
    assert root.evidence in text
    assert '"fault": "weight_corruption"' in text.replace("&quot;", '"')  # the answer key is shown


def test_the_root_band_read_beside_the_analysis_is_the_one_read_after_it(fault_trace: Path) -> None:
    # `report` has the analysis read the root's band from the trace it has open (a connection of
    # its own to the same views), beside the comparators: the same frame as reading it afterwards
    from warninglight.forensics import analyze
    from warninglight.forensics.explaining.analysis import band_of, root_episode

    analysis = analyze(fault_trace, band=True)
    which = band_of(analysis.root)
    assert which is not None and analysis.root_band is not None and len(analysis.root_band) > 100
    assert analysis.root_band.equals(analysis.baseline_frame(*which, hold=root_episode(analysis.root, analysis.alarms)))
    assert analyze(fault_trace).root_band is None  # not asked: not read
    assert report.gather(analysis).root_band is analysis.root_band


def test_the_root_band_is_held_at_the_onset_through_the_episode(fault_trace: Path) -> None:
    # a trailing baseline takes the fault in as its window fills with it: the root's band is the
    # baseline as it stood at the onset, from the onset to the alarm's last step, then trailing
    from warninglight.forensics import analyze
    from warninglight.forensics.explaining.analysis import band_of, root_episode

    analysis = analyze(fault_trace, band=True)
    root, band = analysis.root, analysis.root_band
    assert root is not None and band is not None
    onset, last = root_episode(root, analysis.alarms)
    own = analysis.alarms.filter(observed_on=root.observed_on, metric=root.metric, step=root.alarm_step)
    assert onset == root.onset_step and last == own["last_step"].item() > root.alarm_step + 10
    trailing = analysis.baseline_frame(*band_of(root))
    inside = pl.col("step").is_between(onset, last)
    at_onset = trailing.filter(step=onset)
    for column in ("median", "lower", "upper"):
        assert (band.filter(inside)[column] == at_onset[column].item()).all(), column
    assert band["held"].to_list() == band.select(inside).to_series().to_list()
    assert band.filter(~inside).drop("held").equals(trailing.filter(~inside).drop("held"))
    # the trailing band had taken the fault in by the episode's end; the held one had not
    assert trailing.filter(step=last)["upper"].item() > 10 * at_onset["upper"].item()
    labels = plots.baseline_band(band, root.name, root.metric).axes[0].get_legend_handles_labels()[1]
    assert f"baseline band as at the onset, held over steps {onset}–{last}" in labels


def test_png_format_via_cli(fault_trace: Path, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["report", str(fault_trace), "--format", "png", "-o", str(tmp_path / "figs")])
    assert res.exit_code == 0, res.output
    written = sorted(Path(line).name for line in res.stdout.split())
    assert written == ["conditions.png", "heatmap.png", "loss.png", "root_metric.png"]
    for name in written:
        assert (tmp_path / "figs" / name).read_bytes()[:8] == PNG_MAGIC


def test_cli_rejects_a_folder_that_is_not_a_trace(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["report", str(tmp_path), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 2
    assert "is this a trace directory?" in res.output
    assert "Traceback" not in res.output


def test_components_in_forward_order_and_short_names() -> None:
    comps = pl.DataFrame({"component": ["", "head", "b", "a", "unused"], "forward_index": [None, 2, 1, 0, None]})
    assert contents.component_order(comps) == ["a", "b", "head", "unused"]
    long = "transformer.h.11.attn.c_attn.lora_A.default"
    assert plots.short_name(long) == "…" + long[-(plots.MAX_LABEL - 1):]
    assert len(plots.short_name(long)) == plots.MAX_LABEL
    assert plots.short_name("") == "(root)"


def test_nonfinite_values_are_marked_not_dropped() -> None:
    steps = pl.DataFrame({"step": [1, 2, 3, 4], "loss": [2.0, 1.9, float("nan"), float("inf")],
                          "grad_norm_total_l2": [1.0, None, 1.1, 1.2]})
    fig = plots.loss_and_grad(steps, [plots.Mark("alarm", 3)], never=["loss-spike rule"])
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert sorted(labels) == ["NaN/Inf (2 steps)", "alarm @ 3", "loss-spike rule: never fired"]
    # a missing gradient norm (null: not recorded) is not a non-finite value
    assert not any("NaN/Inf" in t for t in fig.axes[1].get_legend_handles_labels()[1])
    plots.png_bytes(fig)


@pytest.mark.parametrize(("fmt", "make", "fragment"), [
    ("html", lambda p: p.mkdir(), "is a folder; pass an .html file"),
    ("png", lambda p: p.write_text("x"), "is a file; --format png writes into a folder"),
])
def test_cli_out_of_the_wrong_kind_is_one_line(fault_trace: Path, tmp_path: Path, fmt: str, make, fragment: str) -> None:
    out = tmp_path / "out"
    make(out)
    res = CliRunner().invoke(app, ["report", str(fault_trace), "--format", fmt, "-o", str(out)])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and str(out) in lines[0], res.stderr


def test_report_takes_the_same_options_as_analyze(fault_trace: Path, tmp_path: Path) -> None:
    from warninglight.forensics import analyze

    out = tmp_path / "r.html"
    res = CliRunner().invoke(app, ["report", str(fault_trace), "-o", str(out), "--checkpoint-every", "70"])
    assert res.exit_code == 0, res.output
    expected = analyze(fault_trace, checkpoint_every=70)
    assert expected.rollback.checkpoint_step == 140  # the latest multiple of 70 before step 150
    assert wording.analysis_summary_line(expected) in out.read_text().replace("&#x27;", "'")
    bad = CliRunner().invoke(app, ["report", str(fault_trace), "-o", str(out), "--set", "nope.x=1"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_figures_leave_the_callers_matplotlib_backend_alone(tmp_path: Path) -> None:
    """A notebook importing the report keeps its backend: the figures use no pyplot state."""
    script = (
        "import matplotlib, sys; matplotlib.use('svg')\n"
        "import polars as pl\n"
        "from warninglight.forensics.presenting import plots, report, report_html\n"
        "steps = pl.DataFrame({'step': [1, 2], 'loss': [1.0, 0.9], 'grad_norm_total_l2': [1.0, 1.1]})\n"
        "png = plots.png_bytes(plots.loss_and_grad(steps, [plots.Mark('alarm', 2)]))\n"
        "print(matplotlib.get_backend(), png[:4] == b'\\x89PNG', 'matplotlib.pyplot' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["svg", "True", "False"], out.stderr


def test_the_condition_map_of_a_long_run_is_drawn_in_bins_of_steps() -> None:
    # one column per step of a 1e5-step run took gigabytes to draw: a long run gets bins of
    # steps, and a one-step episode still shows in its bin, a named condition over unclassified
    alarms = pl.DataFrame({"observed_on": ["a", "b", "b"], "condition": ["exploding", "unclassified", "dead"],
                           "onset_step": [99_150, 10, 10], "last_step": [99_150, 5_000, 20]})
    fig = plots.condition_map(alarms, ["a", "b", "c"], last_step=99_300)
    image = fig.axes[0].images[0]
    grid = image.get_array()
    width = -(-99_300 // plots.MAP_COLUMNS)  # 125 steps a column: 795 columns
    assert grid.shape == (4, 795) and grid.shape[1] * width >= 99_300  # b: a row per condition
    conditions = ["dead", "exploding", "unclassified"]
    assert grid[0, (99_150 - 1) // width] == conditions.index("exploding")
    assert grid[1, 0] == conditions.index("dead") and grid.mask[1, 1]  # steps 10-20, in the first column
    assert grid[2, 0] == grid[2, (5_000 - 1) // width] == conditions.index("unclassified")  # not drawn over
    assert grid.mask[3].all() and image.get_extent()[1] >= 99_300
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["a", "b", "b", "c"]
    short = plots.condition_map(alarms.head(1).with_columns(pl.lit(150).alias("onset_step"),
                                                            pl.lit(152).alias("last_step")), ["a"], last_step=300)
    assert short.axes[0].images[0].get_array().shape == (1, 300)  # a step per column, as before


def test_the_condition_map_holds_the_alarmed_components_only_and_is_sized_to_them(fault_trace: Path) -> None:
    from warninglight.forensics import analyze

    data = report.gather(analyze(fault_trace))
    alarmed = contents.alarmed_order(data.order, data.analysis.alarms)
    assert alarmed == [c for c in data.order if c in set(data.analysis.alarms["observed_on"])]
    assert 0 < len(alarmed) < len(data.order)
    fig = dict(report._drawers(data))["conditions"]()
    assert [t.get_text().split()[0] for t in fig.axes[0].get_yticklabels()] == alarmed  # one condition each
    assert fig.get_figheight() < plots.heatmap(data.scores, data.order).get_figheight()
    plots.png_bytes(fig)  # laid out
    legend = fig.legends[0].get_window_extent()
    assert legend.y1 <= fig.axes[0].get_window_extent().y0  # below the rows, not over them


def test_no_alarm_no_condition_map(tmp_path: Path) -> None:
    clean = Path(__file__).parent.parent / "sample_traces" / "gpt_clean"
    data = report.gather(report.analyze(clean, band=True))
    assert data.analysis.alarms.is_empty()
    assert "conditions" not in report.images(data)
    assert "What: conditions by component" not in report.write_html(clean, tmp_path / "r.html").read_text()


def test_a_one_step_episode_shows_on_the_condition_map_of_a_long_run_wherever_it_falls() -> None:
    # the map is an image: were it shrunk to fit its axes, columns would be dropped, and with
    # them the episodes they alone held (long labels make the axes narrower)
    order = ["transformer.h.11.mlp.c_fc.very.long.name", "b"]
    kinds = {order[0]: "LlamaFlashAttention2Block"}

    def episode_pixels(component: str, onset: int) -> int:
        alarms = pl.DataFrame({"observed_on": [component], "condition": ["exploding"],
                               "onset_step": [onset], "last_step": [onset]})
        png = plots.png_bytes(plots.condition_map(alarms, order, last_step=99_300, kinds=kinds))
        rgb = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).astype(int)
        return int((np.abs(rgb - (31, 119, 180)).sum(axis=2) < 30).sum())  # tab10's first colour

    legend = episode_pixels("nobody", 5_001)  # the legend's patch alone
    width = -(-99_300 // plots.MAP_COLUMNS)
    for column in range(300, 308):  # eight neighbouring columns: every phase against the pixels
        assert episode_pixels("b", column * width + 1) > legend, column


def test_a_one_bin_departure_shows_on_the_heatmap_whatever_the_labels_leave_of_its_width() -> None:
    # 800 bins of 125 steps; a long label leaves the axes fewer pixels than columns: neighbouring
    # bins are drawn as one column, their worst, and none is dropped
    order = ["transformer.h.11.mlp.c_fc.very.long.name", "b"]
    kinds = {order[0]: "LlamaFlashAttention2Block"}
    steps = np.arange(1, 800 * 125 + 1, 125)

    def dark_pixels(column: int | None) -> tuple[int, plots.Figure]:
        score = np.ones(len(steps))
        if column is not None:
            score[column] = 20.0
        scores = pl.concat([pl.DataFrame({"component": c, "step": steps, "score": score if c == "b" else 1.0})
                            for c in order])
        episode = pl.DataFrame({"observed_on": ["b"], "onset_step": [1], "last_step": [int(steps[-1])]})
        fig = plots.heatmap(scores, order, kinds=kinds, step_width=125, episodes=episode)
        rgb = np.asarray(Image.open(io.BytesIO(plots.png_bytes(fig))).convert("RGB")).astype(int)
        return int((np.abs(rgb - (0x3D, 0x15, 0x02)).sum(axis=2) < 30).sum()), fig  # the ">= 12" colour

    legend, fig = dark_pixels(None)  # the colour bar's swatch alone
    assert fig.axes[0].images[0].get_array().shape[1] < 800  # pooled
    assert "the worst of 2 bins of 125 steps" in fig.axes[2].get_ylabel()  # the alarm colours' bar
    for column in range(300, 308):
        assert dark_pixels(column)[0] > legend, column


def test_a_long_line_is_drawn_from_each_runs_lowest_and_highest_point() -> None:
    step = np.arange(1, 100_001)
    value = np.sin(step / 500.0)
    value[5_000], value[60_000] = 50.0, -40.0  # one-step spikes
    value[7_000:7_200] = np.nan  # nothing recorded: a gap
    x, y = plots._envelope(step, value)
    assert len(x) == len(y) <= 2 * plots.STEP_COLUMNS
    assert np.nanmax(y) == 50.0 and np.nanmin(y) == -40.0 and 5_001 in x and 60_001 in x
    assert (np.diff(x) >= 0).all()  # in step order
    assert np.isnan(y[(x >= 7_050) & (x <= 7_150)]).all() and np.isnan(y).sum() >= 2
    short = np.arange(10.0)
    assert plots._envelope(short, short)[1] is short  # a short line is drawn as it is


def _pixels(fig: plots.Figure, colour: str) -> int:
    rgb = np.asarray(Image.open(io.BytesIO(plots.png_bytes(fig))).convert("RGB")).astype(int)
    want = tuple(int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return int((np.abs(rgb - want).sum(axis=2) < 12).sum())


def test_a_departure_no_alarm_counted_is_drawn_apart_from_an_alarms_episode() -> None:
    # the same |z| of 20 on two components at steps 40-49: one of them in an alarm's episode
    steps = np.arange(1, 101)
    score = np.where((steps >= 40) & (steps < 50), 20.0, 1.0)
    scores = pl.concat([pl.DataFrame({"component": c, "step": steps, "score": score}) for c in ("a", "b")])
    episode = pl.DataFrame({"observed_on": ["b"], "onset_step": [40], "last_step": [49]})
    fig = plots.heatmap(scores, ["a", "b"], episodes=episode)
    aside, alarmed = (im.get_array() for im in fig.axes[0].images)
    assert not aside.mask[0, 39] and aside.mask[1, 39]  # a's departure: set aside, b's: alarmed
    assert alarmed.mask[0, 39] and not alarmed.mask[1, 39] and alarmed.mask[1, 50]
    darkest_alarm, darkest_aside = plots.ALARM_COLOURS[-1], plots.SET_ASIDE_COLOURS[-1]
    with_alarm = (_pixels(fig, darkest_alarm), _pixels(fig, darkest_aside))
    none = plots.heatmap(scores, ["a", "b"])  # no alarm at all: nothing in the alarm colours
    without = (_pixels(none, darkest_alarm), _pixels(none, darkest_aside))
    assert with_alarm[0] > without[0] and with_alarm[1] < without[1]
    assert [ax.get_ylabel().split(":")[0] for ax in fig.axes[1:]] == ["no alarm", "in an alarm's episode"]


def test_the_heatmaps_note_names_the_metrics_no_rule_reads(fault_trace: Path, tmp_path: Path) -> None:
    from warninglight.forensics.judging.conditions import CONDITIONS, Condition, Config
    from warninglight.forensics.presenting import report_html

    assert report_html.unread_metrics(Config()) == ["weight_drift_l2"]
    dropped = tuple(Condition(**{**c.__dict__, "rules": tuple(r for r in c.rules if r.metric != "out_mean")})
                    for c in CONDITIONS)
    assert report_html.unread_metrics(Config(conditions=dropped)) == ["out_mean", "weight_drift_l2"]
    text = report.write_html(fault_trace, tmp_path / "r.html").read_text()
    assert "Blue: a departure no alarm counted" in text and "no rule reads weight_drift_l2" in text


SAMPLES = Path(__file__).parent.parent / "sample_traces"


@pytest.mark.parametrize(("trace", "reasons"), [
    ("gpt_clean", ["none: no alarm, so nothing to roll back", "<td>never lit</td>", "<td>no: no alarm</td>",
                   "(the light saw no fault)</td>",
                   "none: no component left its baseline", "none: no fixed-threshold rule fired"]),
    ("gpt_weight_corruption", ["<td colspan='8'>loss-only operator: the loss-spike rule never fired, so it would "
                               "not roll back</td>", "<td>no: saved before the onset</td>"]),
    ("gpt_nan", ["<td>none: a NaN/Inf rule reads none</td>", "<td>NaN/Inf</td>"]),
    ("cnn_corrupt_batches", ["<td>the same as ours</td>", "<td>none: a loss curve names no batches</td>", "batch ids</td>"]),
])
def test_every_missing_value_in_the_reports_tables_says_why(trace: str, reasons: list[str], tmp_path: Path) -> None:
    # a bare dash left the reader guessing: lost, not applicable, or never computed
    text = report.write_html(SAMPLES / trace, tmp_path / "r.html").read_text().replace("&#x27;", "'")
    cells = re.findall(r"<td[^>]*>(.*?)</td>", text)
    assert len(cells) > 10 and not [c for c in cells if c.strip() in ("—", "", "None", "nan", "[]")]
    for reason in reasons:
        assert reason in text, reason


def test_a_checksum_finding_says_why_it_has_no_z_or_baseline() -> None:
    from warninglight.forensics.explaining.analysis import Alarm
    from warninglight.forensics.presenting import tables

    alarm = Alarm("m.fc", "m.fc", "exploding", 25, 25, None, "weight_checksum", None, 25, 2.0, None)
    assert [tables._alarm_cell(alarm, k) for k in ("magnitude", "value", "median")] == [
        "none: ranks compared", "2 distinct checksums", "none: ranks compared"]
    nan = Alarm("m.fc", "m.fc", "exploding", 25, 25, None, "grad_norm_l2", 0, 25, None, None)
    assert [tables._alarm_cell(nan, k) for k in ("magnitude", "value", "median")] == [
        "none: NaN/Inf", "NaN/Inf", "none: a NaN/Inf rule reads none"]


def test_a_run_shorter_than_the_warm_up_has_no_heatmap_and_says_why(tmp_path: Path) -> None:
    # 40 steps: no component reaches its baseline, and an all-grey map told the reader nothing
    from warninglight.lab.rehearsal import rehearse

    trace = tmp_path / "short"
    rehearse("mlp_weight_corruption", trace, seed=0, steps=40)
    data = report.gather(report.analyze(trace, band=True))
    assert len(data.scores) and data.scores["score"].null_count() == len(data.scores)
    assert "heatmap" not in report.images(data)
    text = report.write_html(trace, tmp_path / "r.html").read_text()
    assert "<h2>Where: every component at every step</h2><p>No map: no component was judged" in text
    assert f"recorded step {data.analysis.warmup_steps} (baseline.min_samples + baseline.lag)" in text
    assert "recorded 40 steps" in text


def test_the_loss_of_several_ranks_is_drawn_once_a_step_as_their_mean() -> None:
    # each rank logs its own loss: their rows one after another drew a saw-tooth
    steps = pl.DataFrame({"step": [1, 1, 2, 2, 3, 3], "rank": [0, 1, 0, 1, 0, 1],
                          "loss": [2.0, 4.0, 1.0, 3.0, float("nan"), 1.0],
                          "grad_norm_total_l2": [1.0, 1.0, None, None, 2.0, 4.0]})
    one, ranks = contents.per_step(steps)
    assert ranks == 2 and one["step"].to_list() == [1, 2, 3]
    assert one["loss"].to_list()[:2] == [3.0, 2.0] and np.isnan(one["loss"][2])  # a NaN on one rank stays
    assert one["grad_norm_total_l2"].to_list() == [1.0, None, 3.0]
    fig = plots.loss_and_grad(one, ranks=ranks)
    x = fig.axes[0].lines[0].get_xdata()
    assert list(x) == [1, 2, 3] and "mean of 2 ranks" in fig.axes[0].get_ylabel()
    alone, ranks = contents.per_step(steps.filter(rank=0))
    assert ranks == 1 and alone.equals(steps.filter(rank=0))  # one rank: as it is


def test_the_rank_panels_legend_lies_below_the_ranks() -> None:
    frame = pl.DataFrame({"rank": [0, 1] * 40, "step": np.repeat(np.arange(1, 41), 2),
                          "local_dev": np.tile([0.5, -0.5], 40), "diverged": [False, True] * 40})
    fig = plots.rank_panel(frame, [plots.Mark("alarm", 25)])
    plots.png_bytes(fig)  # laid out
    assert fig.legends[0].get_window_extent().y1 <= fig.axes[0].get_window_extent().y0
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["weights differ from the majority", "alarm @ 25"]


def test_two_rollbacks_to_one_checkpoint_are_one_mark() -> None:
    # drawn one over the other, the loss-only line hid ours
    data = report.gather(report.analyze(SAMPLES / "cnn_corrupt_batches"))
    rollback = data.analysis.rollback
    assert rollback.checkpoint_step == rollback.loss_only.checkpoint_step == 100
    labels = [(m.label, m.step) for m in contents.marks(data) if m.label.startswith("rollback")]
    assert labels == [(plots.SAME_ROLLBACK, 100)]
    other = report.gather(report.analyze(SAMPLES / "gpt_weight_corruption"))  # the loss rule never fired
    assert [m.label for m in contents.marks(other) if m.label.startswith("rollback")] == ["rollback (ours)"]
