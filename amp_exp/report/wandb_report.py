"""A sweep as a saved W&B Report: the verdicts and table of report.md beside the dashboard panels
that compare the sweep's runs, on one page of the project they logged to.

The runs are found by the W&B run ids their directories kept, so runs logged offline and uploaded
later with ``wandb sync`` get their page the same way. ``sweep_page`` gathers plain data from the
run directories, ``build_page`` turns it into a Report without any network, and ``save_page``
saves it within a time limit. wandb and wandb-workspaces are imported only when a page is built:
together they take about 3 s.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amp_exp.report.compare import REPLICATE_KEY, declared_metrics, varied_keys
from amp_exp.report.markdown import evidence_table, markdown_table, verdict_lines
from amp_exp.report.runs import Run, find_runs
from amp_exp.results.dashboard import (
    FLOPS_SHARE_PREFIX,
    SKIP_RATE,
    SUMMARIES,
    WANDB_KEYS,
    X_AXIS,
    wandb_key_of,
)
from amp_exp.results.files import WANDB_RUN_ID_FILE, read_data
from amp_exp.results.wandb_logger import NO_API_KEY, describe

EXTRA = "wandb-report"
MISSING_LIBRARY = f"a W&B report needs wandb-workspaces: pip install 'amp_exp[{EXTRA}]'"
# What ran: precision.name may be auto (results/dashboard.py run_config).
PRECISION_KEY = "precision.resolved"
# run_config logs the precision keys flat ("precision.init_scale"), every other section nested.
FLAT_SECTION = "precision."
# The language-model task logs this instead of samples/s.
TOKENS_PER_S_KEY = "perf/tokens_per_s"
TITLE_MAX_CHARS = 128  # W&B refuses longer report titles
PANEL_WIDTH, PANEL_HEIGHT, GRID_COLUMNS = 8, 6, 3  # W&B's grid is 24 units wide


class WandbReportError(Exception):
    """No W&B report was saved; the message is one line that says why."""


@dataclass(frozen=True)
class SweepPage:
    """Everything the W&B report of a sweep shows, as plain values."""

    entity: str | None  # None: the API key's default entity, as the runs logged
    project: str
    title: str
    description: str
    run_ids: tuple[str, ...]
    verdicts: tuple[str, ...]  # markdown lines: the verdict list of report.md
    evidence: tuple[str, ...]  # markdown lines: the verdict table of report.md
    table: tuple[str, ...]  # markdown lines
    swept_keys: tuple[str, ...]  # dotted config keys ("optimizer.lr"), precision.resolved first
    eval_key: str
    throughput_key: str
    # The dtypes the runs' audited matmuls ran in (results/dashboard.py audit_summary).
    flops_dtypes: tuple[str, ...] = ()


def _run_id(run: Run) -> str | None:
    path = run.path / WANDB_RUN_ID_FILE
    return read_data(path).decode("utf-8").strip() if path.is_file() else None


def logged_online(run: Run) -> bool:
    """Whether W&B wrote the run's files as an online run (``wandb/run-<time>-<id>``)."""
    run_id = _run_id(run)
    return run_id is not None and any((run.path / "wandb").glob(f"run-*-{run_id}"))


def sweep_page(runs: list[Run], report: dict[str, Any], out_dir: Path) -> SweepPage:
    """The page for the runs that kept a W&B run id, with ``report``'s verdicts and table."""
    logged = [run for run in runs if _run_id(run) is not None]
    if not logged:
        raise WandbReportError(
            f"no W&B runs under {out_dir}: no run directory holds a {WANDB_RUN_ID_FILE} file "
            "(were they run with wandb.mode=disabled?)"
        )
    configs = [(run.summary.get("config") or {}).get("wandb") or {} for run in logged]
    places = {(config.get("entity"), config.get("project")) for config in configs}
    if len(places) > 1:
        named = ", ".join(
            sorted(f"{entity or '(default)'}/{project}" for entity, project in places)
        )
        raise WandbReportError(
            f"the runs logged to more than one W&B project ({named}); give the directories of one"
        )
    ((entity, project),) = places
    if not project:
        raise WandbReportError(f"the runs under {out_dir} name no W&B project in their config")
    declared = declared_metrics(*(run.summary for run in logged))
    tokens = any(
        run.summary.get("tokens_per_s") is not None
        or any(row.get("tokens_per_s") is not None for row in run.metrics)
        for run in logged
    )
    audits = [run.summary.get("precision_audit") or {} for run in logged]
    # W&B's config has no wandb section, and precision.resolved stands for precision.name.
    varied = [key for key in varied_keys(logged) if key != "precision.name"]
    varied = [key for key in varied if not key.startswith("wandb.")]
    return SweepPage(
        entity=entity,
        project=project,
        # No "/": the report's URL is made from its title.
        title=f"amp_exp sweep {out_dir.parent.name} {out_dir.name}"[:TITLE_MAX_CHARS],
        description=f"{len(logged)} W&B runs of the {len(runs)} runs in {out_dir.resolve()}",
        run_ids=tuple(str(_run_id(run)) for run in logged),
        verdicts=tuple(verdict_lines(report)),
        evidence=tuple(evidence_table(report)),
        table=tuple(markdown_table(report["runs"])),
        swept_keys=(PRECISION_KEY, *varied),
        # The quality metric the runs' task declares (eval/loss if none does).
        eval_key=wandb_key_of(declared.quality if declared else "eval_loss") or "eval/loss",
        throughput_key=TOKENS_PER_S_KEY if tokens else WANDB_KEYS["samples_per_s"],
        flops_dtypes=tuple(
            dict.fromkeys(dtype for audit in audits for dtype in audit.get("flops_by_dtype") or {})
        ),
    )


def reports_api() -> Any:
    """``wandb_workspaces.reports.v2``, or a one-line error that names the extra to install."""
    try:
        import wandb_workspaces.reports.v2 as wr
    except ImportError as error:
        raise WandbReportError(f"{MISSING_LIBRARY} ({error})") from error
    return wr


def _summary_key(key: str) -> str:
    # A metric with a summary of its own (define_metric) keeps it under "<key>.<summary>".
    return f"{key}.{SUMMARIES[key]}" if key in SUMMARIES else key


@functools.cache
def _flat_config_column(wr: Any) -> type:
    """A parallel-coordinates axis for a flat config key.

    wandb-workspaces writes a config key's path as nested ("optimizer.value.lr"), but W&B
    stores the flat keys of run_config as ``{"precision.resolved": {"value": ...}}``, whose
    path is "precision.resolved.value".
    """
    from wandb_workspaces.reports.v2 import internal

    class FlatConfigColumn(wr.ParallelCoordinatesPlotColumn):
        def _to_model(self) -> Any:
            return internal.Column(accessor=f"config:{self.metric.name}.value")

    return FlatConfigColumn


def _config_column(wr: Any, key: str) -> Any:
    flat = key.startswith(FLAT_SECTION)
    return (_flat_config_column(wr) if flat else wr.ParallelCoordinatesPlotColumn)(wr.Config(key))


def _group_key(key: str) -> str:
    """A Runset's groupby string for a config key (flat or nested: see _config_column)."""
    return f"config.{key}.value" if key.startswith(FLAT_SECTION) else f"config.{key}"


def _panels(wr: Any, page: SweepPage) -> list[Any]:
    memory_key = WANDB_KEYS["peak_mem_bytes"]
    # The runs of a group are the seeds of one precision and setting: their mean, in a band
    # from the lowest to the highest seed.
    seeds = {"groupby_aggfunc": "mean", "groupby_rangefunc": "minmax"}
    charts = [
        wr.LinePlot(title="training loss", x=X_AXIS, y=[WANDB_KEYS["loss"]], **seeds),
        # As read at each log step, and its geometric mean over the steps since the last.
        wr.LinePlot(
            title="fp16 loss scale",
            x=X_AXIS,
            y=[WANDB_KEYS["scale"], WANDB_KEYS["scale_mean"]],
            log_y=True,
            **seeds,
        ),
        wr.LinePlot(title="share of steps skipped", x=X_AXIS, y=[SKIP_RATE], **seeds),
        wr.LinePlot(title=page.eval_key, x=X_AXIS, y=[page.eval_key], **seeds),
        wr.BarPlot(title="throughput", metrics=[page.throughput_key], orientation="v"),
        wr.BarPlot(title="peak memory (bytes)", metrics=[memory_key], orientation="v"),
    ]
    if page.flops_dtypes:
        charts.append(
            wr.BarPlot(
                title="matmul FLOPs by dtype (audited step), per run",
                metrics=[f"{FLOPS_SHARE_PREFIX}{dtype}" for dtype in page.flops_dtypes],
                orientation="v",
                max_runs_to_show=len(page.run_ids),
            )
        )
    for i, chart in enumerate(charts):
        chart.layout = wr.Layout(
            x=PANEL_WIDTH * (i % GRID_COLUMNS),
            y=PANEL_HEIGHT * (i // GRID_COLUMNS),
            w=PANEL_WIDTH,
            h=PANEL_HEIGHT,
        )
    outcomes = [page.throughput_key, memory_key, page.eval_key]
    parallel = wr.ParallelCoordinatesPlot(
        title="what each setting bought",
        columns=[
            *(_config_column(wr, key) for key in page.swept_keys),
            *(
                wr.ParallelCoordinatesPlotColumn(wr.SummaryMetric(_summary_key(k)))
                for k in outcomes
            ),
        ],
        layout=wr.Layout(
            x=0,
            y=PANEL_HEIGHT * -(-len(charts) // GRID_COLUMNS),
            w=PANEL_WIDTH * GRID_COLUMNS,
            h=PANEL_HEIGHT + 2,
        ),
    )
    return [*charts, parallel]


def build_page(page: SweepPage, entity: str) -> Any:
    """The Report (``wandb_workspaces.reports.v2.Report``) for ``page``; nothing is sent."""
    wr = reports_api()
    from wandb_workspaces import expr

    runset = wr.Runset(
        entity=entity,
        project=page.project,
        name="this sweep",
        filters=expr.And(expr.Metric("ID").isin(list(page.run_ids))),
        # A group per precision and setting, so that the seeds of each are one line.
        groupby=[_group_key(key) for key in page.swept_keys if key != REPLICATE_KEY],
    )
    return wr.Report(
        entity=entity,
        project=page.project,
        title=page.title,
        description=page.description,
        width="fluid",
        blocks=[
            wr.H2("Verdict"),
            wr.MarkdownBlock("\n".join(page.verdicts)),
            wr.MarkdownBlock("\n".join(page.evidence)),
            wr.H2("Runs by precision and setting: the mean of the seeds, in their min-max band"),
            wr.PanelGrid(runsets=[runset], panels=_panels(wr, page)),
            wr.H2("Runs"),
            wr.MarkdownBlock("\n".join(page.table)),
        ],
    )


def unreachable(base_url: str, timeout: float) -> str | None:
    """Why the server at ``base_url`` cannot be reached, or None when it answers at all.

    W&B's own client retries a refused connection until its timeout; this finds out at once.
    """
    try:
        urllib.request.urlopen(base_url, timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # it answered, if only to refuse
    except (OSError, ValueError) as error:  # refused, no such host, timed out, not a URL
        reason = getattr(error, "reason", error)
        return describe(reason) if isinstance(reason, BaseException) else str(reason)
    return None


def save_page(page: SweepPage, timeout: float) -> str:
    """Save the page's Report to the W&B server and return its URL, within ``timeout`` seconds.

    Never asks for an API key: without one it stops at once.
    """
    reports_api()
    # W&B's own crash reporting can hold the process about 10 s at exit without a network.
    os.environ.setdefault("WANDB_ERROR_REPORTING", "false")
    import wandb

    # Online settings, or login() refuses under WANDB_MODE=offline; silence keeps W&B from
    # prompting for a key and from printing its own lines.
    base_url = wandb.setup(settings=wandb.Settings(mode="online", silent=True)).settings.base_url
    if not wandb.login(prompt=False, verify=False):
        raise WandbReportError(f"no W&B report: {NO_API_KEY}")
    deadline = time.monotonic() + timeout
    why = unreachable(base_url, timeout)
    if why is not None:
        raise WandbReportError(f"no W&B report: cannot reach {base_url} ({why})")
    outcome: dict[str, Any] = {}

    def save() -> None:
        try:
            api = wandb.Api(timeout=max(1, int(timeout)))  # checks the key with the server
            report = build_page(page, page.entity or api.default_entity)
            report.save()
            outcome["url"] = report.url
        except Exception as error:
            outcome["error"] = error

    # A server that accepts but never answers would hold W&B's retries for minutes: the page is
    # saved in a daemon thread that the caller leaves behind at the deadline.
    worker = threading.Thread(target=save, name="wandb-report", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if worker.is_alive():
        raise WandbReportError(
            f"no W&B report: {base_url} did not answer within {timeout:g} s "
            "(report.wandb_timeout, --wandb-timeout)"
        )
    if "error" in outcome:
        raise WandbReportError(f"no W&B report: {describe(outcome['error'])}")
    return str(outcome["url"])


def publish_report(
    dirs: list[Path],
    out_dir: Path,
    report: dict[str, Any],
    timeout: float,
    require_online: bool = False,
) -> str:
    """Save the W&B report of the runs under ``dirs`` (``report`` is build_report's) and return
    its URL. With ``require_online``, runs that logged offline and are not yet synced are not
    looked for on the server."""
    runs = find_runs(dirs)
    if require_online and not any(logged_online(run) for run in runs):
        raise WandbReportError(
            f"the runs logged offline: after `wandb sync`, make it with "
            f"`python -m amp_exp.report {out_dir} --wandb`"
        )
    return save_page(sweep_page(runs, report, out_dir), timeout)
