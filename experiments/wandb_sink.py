"""The one seam to wandb: one run per arm or sweep point, in one group per ablation or
sweep, plus a summary run with the table and the plots.

Must never: block on the network (offline unless asked for online or an API key is set;
an online start that fails falls back to offline) or import wandb in `disabled` mode.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

from preempt.obs.tracking import ONLINE_INIT_TIMEOUT_S  # one timeout for every wandb run


def jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()}


class WandbSink:
    """The seam to wandb: `point(...)` logs one run per arm and point (config = the resolved
    engine config, summary = its metrics), `summary(...)` one run with the results table
    (wandb.Table) and the plots (wandb.Image), all in one group under DIR/wandb. With
    mode `disabled` it does nothing and never imports wandb."""

    def __init__(self, mode: str, out_dir: Path, project: str, group: str) -> None:
        self.mode, self.out_dir, self.project, self.group = mode, out_dir, project, group
        self.num_runs = 0
        self._saved_env: dict[str, str | None] = {}
        if mode == "disabled":
            return
        # Everything wandb writes (runs, its own logs) goes under DIR, for this command only.
        for name, value in (("WANDB_DIR", str(out_dir)), ("WANDB_SILENT", "true")):
            self._saved_env[name] = os.environ.get(name)
            os.environ[name] = value
        import wandb

        self.wandb = wandb
        # console off: the CLI's own output stays readable; no stats sampler for short runs.
        self.settings = dict(
            silent=True, console="off", x_disable_stats=True, init_timeout=ONLINE_INIT_TIMEOUT_S
        )

    def _init(self, **kwargs: Any) -> Any:
        def start(mode: str) -> Any:
            return self.wandb.init(
                project=self.project,
                group=self.group,
                dir=str(self.out_dir),
                mode=mode,
                reinit="create_new",
                settings=self.wandb.Settings(**self.settings),
                **kwargs,
            )

        if self.mode == "online":
            try:
                return start("online")
            except Exception as err:  # CommError, UsageError, timeouts: never hold the ablation up
                warnings.warn(
                    f"wandb online failed ({err}); logging offline under {self.out_dir}", stacklevel=2
                )
                self.mode = "offline"
        return start(self.mode)

    def point(
        self,
        name: str,
        config: dict[str, Any],
        summary: dict[str, Any],
        steps: list[dict[str, Any]] = (),
    ) -> None:
        """One run (`job_type=point`) for one arm at one point: `config` its resolved engine
        config and what the arm is; `summary` its metrics (with seeds: means and interval
        bounds); one logged step per seed with that seed's metrics."""
        if self.mode == "disabled":
            return
        wb = self._init(name=name, job_type="point", config=config)
        for step in steps:
            wb.log({k: v for k, v in jsonable(step).items() if isinstance(v, int | float)})
        wb.summary.update({k: v for k, v in jsonable(summary).items() if v is not None and k != "notes"})
        wb.finish()
        self.num_runs += 1

    def summary(self, rows: list[dict[str, Any]], plots: list[Path], info: dict[str, Any]) -> None:
        if self.mode == "disabled":
            return
        wb = self._init(name=f"{self.group}/summary", job_type="summary", config=info)
        columns = list(rows[0])
        data = [[None if isinstance(v, float) and math.isnan(v) else v for v in row.values()] for row in rows]
        wb.log(
            {
                "results": self.wandb.Table(columns=columns, data=data, allow_mixed_types=True),
                **{f"plots/{path.stem}": self.wandb.Image(str(path)) for path in plots},
            }
        )
        wb.finish()
        self.num_runs += 1

    def close(self) -> None:
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def sync_hint(self) -> str | None:
        if self.mode != "offline" or not self.num_runs:
            return None
        return (
            f"wandb sync {self.out_dir / 'wandb'}/offline-run-*   # upload the {self.num_runs} offline runs"
        )
