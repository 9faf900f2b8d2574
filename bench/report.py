"""Summaries of benchmark runs: medians, targets, a markdown table and a PNG bar chart."""

from __future__ import annotations

import statistics
from typing import Any

MiB, GiB = 1 << 20, 1 << 30

# (direction, peer, minimum ratio of fastckpt's median throughput to the peer's), from issues 8 and 13.
S3_TARGETS = [("upload", "pyarrow", 1.5), ("upload", "s5cmd", 1.5), ("download", "pyarrow", 2.0),
              ("download", "s5cmd", 1.2)]
SMALL_FILES_TARGETS = [("upload", "s5cmd", 1.0), ("download", "s5cmd", 1.0)]
"""Those of a checkpoint of many small files (``--files``, sizes labelled ``NNNfiles``): files/s."""
CPU_TARGET = 0.5
"""Client CPU seconds per GiB fastckpt must stay under, both ways (large files; small ones cost per request)."""
RSS_FLAT = 1.25
"""Largest allowed ratio of fastckpt's peak RSS at the largest size to that at the smallest."""


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (size, engine, direction), in first-seen order; failed or unverified runs do not count."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["size"], run["engine"], run["direction"]), []).append(run)
    rows = []
    for (size, engine, direction), group in groups.items():
        ok = [r for r in group if r["ok"] and r["verified"]]
        rates = [r["bytes"] / MiB / r["wall_s"] for r in ok]
        row: dict[str, Any] = {
            "size": size, "engine": engine, "direction": direction, "bytes": group[0]["bytes"],
            "runs": len(group), "ok": len(ok),
            "mib_s": _median(rates), "mib_s_min": min(rates, default=None), "mib_s_max": max(rates, default=None),
            "cpu_s_per_gib": _median([r["cpu_s"] / (r["bytes"] / GiB) for r in ok]),
            "peak_rss_mib": max((r["maxrss_mib"] for r in ok), default=None),
            "rss_before_mib": max((r["rss_before_mib"] for r in ok), default=None),
            "errors": sorted({(r.get("error") or "; ".join(r.get("problems", [])))[:300] for r in group
                              if not (r["ok"] and r["verified"])}),
        }
        row["gib_s"] = row["mib_s"] / 1024 if row["mib_s"] else None
        for key in ("hash_cpu_s", "server_cpu_s"):
            values = [r[key] / (r["bytes"] / GiB) for r in ok if r.get(key) is not None]
            row[f"{key}_per_gib"] = _median(values)
        idle = [r["machine_idle"] for r in ok if r.get("machine_idle") is not None]
        row["machine_idle_pct"] = 100 * _median(idle) if idle else None
        for key in ("blocked_s", "d2h_s", "requests"):
            values = [r[key] for r in ok if r.get(key) is not None]
            if values:
                row[key] = _median(values)
        rows.append(row)
    return rows


def _find(rows: list[dict[str, Any]], size: str, engine: str, direction: str) -> dict[str, Any] | None:
    for row in rows:
        if (row["size"], row["engine"], row["direction"]) == (size, engine, direction) and row["mib_s"]:
            return row
    return None


def check_targets(rows: list[dict[str, Any]], s3: bool) -> list[dict[str, Any]]:
    """Issues 8 and 13's targets (ratios to peers in the same run, CPU, flat RSS) as pass/fail rows."""
    out = []
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    for size in sizes:
        small_files = size.endswith("files")
        if s3:
            for direction, peer, ratio in SMALL_FILES_TARGETS if small_files else S3_TARGETS:
                mine, theirs = _find(rows, size, "fastckpt", direction), _find(rows, size, peer, direction)
                if mine and theirs:
                    got = mine["mib_s"] / theirs["mib_s"]
                    out.append({"size": size, "target": f"{direction} >= {ratio}x {peer}",
                                "value": f"{got:.2f}x", "pass": got >= ratio})
        for direction in ("upload", "download"):
            mine = _find(rows, size, "fastckpt", direction)
            if not mine or mine["cpu_s_per_gib"] is None:
                continue
            others = [r["cpu_s_per_gib"] for r in rows if r["size"] == size and r["direction"] == direction
                      and r["engine"] != "fastckpt" and r["cpu_s_per_gib"] is not None]
            if s3 and not small_files:
                out.append({"size": size, "target": f"{direction} CPU <= {CPU_TARGET} s/GiB",
                            "value": f"{mine['cpu_s_per_gib']:.2f}", "pass": mine["cpu_s_per_gib"] <= CPU_TARGET})
            if others:
                out.append({"size": size, "target": f"{direction} CPU lowest of all",
                            "value": f"{mine['cpu_s_per_gib']:.2f} vs min {min(others):.2f}",
                            "pass": mine["cpu_s_per_gib"] <= min(others)})
    if len(sizes) > 1:
        for direction in ("upload", "download"):
            small, large = _find(rows, sizes[0], "fastckpt", direction), _find(rows, sizes[-1], "fastckpt", direction)
            if small and large:
                ratio = large["peak_rss_mib"] / small["peak_rss_mib"]
                out.append({"size": f"{sizes[0]}->{sizes[-1]}", "target": f"{direction} peak RSS flat",
                            "value": f"{small['peak_rss_mib']:.0f} -> {large['peak_rss_mib']:.0f} MiB",
                            "pass": ratio <= RSS_FLAT})
    return out


def _fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[dict[str, Any]], targets: list[dict[str, Any]], title: str) -> str:
    """The summary as markdown tables."""
    gpu = any("blocked_s" in r for r in rows)
    head = ["size", "engine", "direction", "MiB/s median (min-max)", "GiB/s", "CPU s/GiB", "peak RSS MiB",
            "hash CPU s/GiB", "server CPU s/GiB", "machine idle %"] + (["blocked s"] if gpu else []) + ["ok runs"]
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rate = "FAILED" if r["mib_s"] is None else \
            f"{r['mib_s']:.0f} ({r['mib_s_min']:.0f}-{r['mib_s_max']:.0f})"
        cells = [r["size"], r["engine"], r["direction"], rate, _fmt(r["gib_s"], ".2f"), _fmt(r["cpu_s_per_gib"], ".2f"),
                 _fmt(r["peak_rss_mib"]), _fmt(r.get("hash_cpu_s_per_gib"), ".2f"),
                 _fmt(r.get("server_cpu_s_per_gib"), ".2f"), _fmt(r.get("machine_idle_pct"))]
        if gpu:
            cells.append(_fmt(r.get("blocked_s"), ".2f"))
        cells.append(f"{r['ok']}/{r['runs']}")
        lines.append("| " + " | ".join(cells) + " |")
    if targets:
        lines += ["", "| size | target | value | met |", "|---|---|---|---|"]
        lines += [f"| {t['size']} | {t['target']} | {t['value']} | {'yes' if t['pass'] else 'NO'} |" for t in targets]
    errors = [(r, e) for r in rows for e in r["errors"]]
    if errors:
        lines += ["", "Failed or unverified runs:"]
        lines += [f"- {r['size']} {r['engine']} {r['direction']}: {e}" for r, e in errors]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    """Bar chart: throughput (median, min-max whiskers), CPU s/GiB and peak RSS per engine and direction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['engine']}\n{r['direction']}\n{r['size']}" for r in rows]
    colors = ["tab:red" if r["engine"].startswith("fastckpt") else "tab:blue" for r in rows]
    x = range(len(rows))
    fig, axes = plt.subplots(3, 1, figsize=(max(8, 0.9 * len(rows) + 2), 11), sharex=True)
    med = [r["mib_s"] or 0 for r in rows]
    err = [[m - (r["mib_s_min"] or m) for m, r in zip(med, rows, strict=True)],
           [(r["mib_s_max"] or m) - m for m, r in zip(med, rows, strict=True)]]
    axes[0].bar(x, med, color=colors, yerr=err, capsize=3)
    axes[0].set_ylabel("MiB/s (median, min-max)")
    axes[1].bar(x, [r["cpu_s_per_gib"] or 0 for r in rows], color=colors)
    axes[1].set_ylabel("client CPU s / GiB")
    axes[2].bar(x, [r["peak_rss_mib"] or 0 for r in rows], color=colors)
    axes[2].set_ylabel("peak RSS MiB")
    axes[2].set_xticks(list(x), labels, fontsize=7)
    axes[0].set_title(title)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
