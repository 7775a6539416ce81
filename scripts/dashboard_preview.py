"""Evaluates every query of the Grafana dashboard (helm/kvshare/dashboards/kvshare.json) with a real
Prometheus scraping two live workers while the fault cases of bench/faults.py run, and plots each
panel's series into one PNG (docs/dashboard.png). Grafana itself is not needed: this checks that
the queries return what their panels say (label names included, which a parser cannot check), and
shows an operator what the panels look like during faults.

Needs a ``prometheus`` binary on PATH (Debian: ``apt-get install prometheus``).

    .venv/bin/python scripts/dashboard_preview.py [--smoke] [--out docs/dashboard.png]
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlencode
from urllib.request import urlopen

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fleet import INTRA_OP_THREADS, bench_model, parse_args  # noqa: E402
from services.local.redis_process import free_port  # noqa: E402
from services.local.store_faults import CASES, CLIENTS, lab, settle_for, workload_for  # noqa: E402
from services.local.traffic import Traffic  # noqa: E402

DASHBOARD = ROOT / "helm" / "kvshare" / "dashboards" / "kvshare.json"
SCRAPE_S = 1
RATE_WINDOW = "15s"
HEALTHY_S = 30.0
"""Traffic on a healthy store before the first fault, so that every rate has a baseline."""


class Prometheus:
    """A throwaway Prometheus scraping ``targets`` every second, its data in a temporary folder."""

    def __init__(self, targets: list[str]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise SystemExit("prometheus is not on PATH (Debian: apt-get install prometheus)")
        self._dir = Path(tempfile.mkdtemp(prefix="kvshare-prometheus-"))
        config = {"global": {"scrape_interval": f"{SCRAPE_S}s"},
                  "scrape_configs": [{"job_name": "kvshare", "static_configs": [{"targets": targets}]}]}
        (self._dir / "prometheus.yml").write_text(json.dumps(config))
        self.port = free_port()
        self._process = subprocess.Popen(
            [binary, f"--config.file={self._dir / 'prometheus.yml'}", f"--storage.tsdb.path={self._dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not self._ready():
            if time.monotonic() > deadline or self._process.poll() is not None:
                raise RuntimeError("prometheus did not start")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            return urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1).status == 200
        except OSError:
            return False

    def query_range(self, expr: str, start: float, end: float, step_s: float) -> list[dict]:
        query = urlencode({"query": expr, "start": start, "end": end, "step": step_s})
        reply = json.loads(urlopen(f"http://127.0.0.1:{self.port}/api/v1/query_range?{query}", timeout=30).read())
        if reply["status"] != "success":
            raise RuntimeError(f"{expr}: {reply}")
        return reply["data"]["result"]

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(10)
        shutil.rmtree(self._dir, ignore_errors=True)


def legend(template: str, labels: dict[str, str]) -> str:
    for name, value in labels.items():
        template = template.replace("{{" + name + "}}", value)
    return template


def plot(panels: list[dict], series: list[list[tuple[str, list[float], list[float]]]], marks: list[tuple[float, str]],
         out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(18, 3.2 * rows), squeeze=False)
    for ax, panel, lines in zip(axes.flat, panels, series, strict=False):
        for label, xs, ys in lines:
            ax.plot(xs, ys, label=label, linewidth=1.2)
        for at, _ in marks:
            ax.axvline(at, color="grey", linewidth=0.6, linestyle=":")
        ax.set_title(panel["title"], fontsize=9)
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        ax.set_ylabel({"percentunit": "fraction", "s": "seconds", "Bps": "bytes/s"}.get(unit, ""), fontsize=8)
        ax.tick_params(labelsize=7)
        if lines:
            ax.legend(fontsize=6, loc="upper right")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[0]:
        for at, name in marks[1:]:
            ax.annotate(name, (at, 1.0), xycoords=("data", "axes fraction"), fontsize=6, rotation=90, va="top",
                        color="grey")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=80)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0],
                      lambda p: p.add_argument("--out", type=Path, default=ROOT / "docs" / "dashboard.png"))

    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    model = bench_model(args)
    marks: list[tuple[float, str]] = []
    with lab(model.folder, workload_for(model.vocab_size, args.smoke), INTRA_OP_THREADS) as the_lab:
        prometheus = Prometheus([f"127.0.0.1:{p}" for p in the_lab.metrics_ports])
        try:
            start = time.time()
            marks.append((0.0, "healthy"))
            with Traffic([w.target for w in the_lab.workers], the_lab.workload, the_lab.references, CLIENTS) as traffic:
                time.sleep(HEALTHY_S)
            print(f"healthy: {traffic.stop().sent} requests")
            for name in CASES:
                marks.append((time.time() - start, name))
                result = the_lab.run(name, settle_for(args.smoke))
                print(f"{name}: {result.summary.sent} requests, failed {result.summary.failed_text}, "
                      f"wrong {result.summary.wrong}, the workers saw {result.seen_text}")
            time.sleep(3 * SCRAPE_S)
            end = time.time()
            series, empty = [], []
            for panel in panels:
                lines = []
                for target in panel["targets"]:
                    expr = target["expr"].replace("$__rate_interval", RATE_WINDOW).replace("$job", ".*")
                    for result in prometheus.query_range(expr, start, end, step_s=2):
                        xs = [float(t) - start for t, _ in result["values"]]
                        ys = [float(v) for _, v in result["values"]]
                        lines.append((legend(target.get("legendFormat", ""), result["metric"]), xs, ys))
                series.append(lines)
                if not lines:
                    empty.append(panel["title"])
        finally:
            prometheus.stop()
    plot(panels, series, marks, args.out,
         f"kvshare dashboard queries evaluated by Prometheus over two live workers (model {model.name}) during the "
         "fault cases of bench/faults.py (dotted lines, named on the top row); seconds on the x axis.\n"
         "Sums are over both workers (breakers: how many are open). Quantiles are interpolated within histogram "
         "buckets, so a p99 sits on a bucket bound (10 s, 30 s) when few requests are in the window.")
    print(f"wrote {args.out}")
    if empty:
        print("panels with no data: " + "; ".join(empty))
    return 0


if __name__ == "__main__":
    sys.exit(main())
