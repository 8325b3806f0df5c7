"""Aggregating run records into rows, printing the table, writing CSV/JSON and drawing the chart."""

from __future__ import annotations

import csv
import json
import os
import statistics

from .impls import ALL_LOADERS as LOADER_ORDER

COLORS = {"naive": "#888888", "lazy": "#bbbbbb", "fastsafetensors": "#1f77b4", "runai": "#9467bd",
          "raylazy-ranged": "#d62728", "raylazy-fst": "#ff9896", "raylazy-coop": "#ff7f0e", "raylazy-coop-readers": "#ffbb78", "raw": "#2ca02c"}


def scenario(row) -> str:
    if row["tp"] == 1:
        return f"tp1 {row['cache']}"
    where = "node" if row["placement"] == "node" else "rank/node"
    return f"tp{row['tp']} {where} {row['cache']}"


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate(records: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        groups.setdefault((rec["loader"], rec["tp"], rec["placement"], rec["cache"]), []).append(rec)
    rows = []
    for (loader, tp, placement, cache), recs in groups.items():
        walls = [r["wall_s"] for r in recs]
        e2e = [r["e2e_s"] for r in recs if r.get("e2e_s") is not None]
        ranks = [rk for r in recs for rk in r["ranks"]]
        row = {
            "loader": loader, "tp": tp, "placement": placement, "cache": cache, "runs": len(recs),
            "wall_s": _med(walls), "wall_min_s": min(walls), "wall_max_s": max(walls),
            "e2e_s": _med(e2e), "e2e_min_s": min(e2e) if e2e else None, "e2e_max_s": max(e2e) if e2e else None,
            "e2e_cpu_s": _med([r.get("e2e_cpu_s") for r in recs]),
            "cpu_s": _med([r["cpu_s"] for r in recs]),
            "pulled_bytes": _med([r["pulled_bytes"] for r in recs]),
            "pulled_from": "diskstats" if recs[0]["dev_read_bytes"] is not None else "read_bytes",
            "dev_requests": _med([r["dev_requests"] for r in recs]),
            "dev_merged": _med([r["dev_merged"] for r in recs]),
            "mean_request_bytes": _med([r["dev_mean_request"] for r in recs]),
            "procs_read_bytes": _med([r["procs_read_bytes"] for r in recs]),
            "rchar_bytes": _med([r["rchar"] for r in recs]),
            "need_exact_bytes": recs[0]["need_exact"],
            "need_pages_bytes": recs[0]["need_pages"],
            "shard_bytes_per_rank": max(rk.get("shard_bytes", 0) for rk in ranks),
            "peak_rss_per_rank": max(rk.get("peak_rss", 0) for rk in ranks),
            "peak_uss_per_rank": max(rk.get("sampled_uss", 0) for rk in ranks),
            "peak_anon_per_rank": max(rk.get("sampled_anon", 0) for rk in ranks),
            "peak_anon_extra_per_rank": max(rk.get("sampled_anon", 0) - rk.get("anon_base", rk.get("anon_before", 0))
                                            for rk in ranks),
            "staging_bytes_per_rank": max((rk.get("staging_bytes", 0) for rk in ranks), default=0),
            "resident_before_max": max(r["resident_before"] for r in recs),
            "load1_median": _med([r["load1"] for r in recs]),
            "others_cores_max": max((r.get("others_cores_before") or 0.0 for r in recs), default=0.0),
            "verified": _verdict([r.get("verified") for r in recs]),
        }
        row["private_over_shard_per_rank"] = max(
            rk.get("sampled_anon", 0) - rk.get("anon_base", rk.get("anon_before", 0)) - rk.get("shard_bytes", 0)
            for rk in ranks)
        row["amp"] = row["pulled_bytes"] / row["need_pages_bytes"] if row["need_pages_bytes"] else None
        row["amp_exact"] = row["pulled_bytes"] / row["need_exact_bytes"] if row["need_exact_bytes"] else None
        row["amp_rank_max"] = _med([max(rk["pulled_bytes"] / rk["need_pages"] for rk in r["ranks"]) for r in recs]) \
            if placement != "node" else None
        row["gbps"] = row["need_exact_bytes"] / row["wall_s"] / 1e9 if row["wall_s"] else None
        rows.append(row)
    for row in rows:  # ratios within the same scenario of the same run
        for ref in ("naive", "raw"):
            other = next((o for o in rows if o["loader"] == ref and o["tp"] == row["tp"]
                          and o["placement"] == row["placement"] and o["cache"] == row["cache"]), None)
            row[f"wall_vs_{ref}"] = row["wall_s"] / other["wall_s"] if other and other["wall_s"] else None
    key = {n: i for i, n in enumerate(LOADER_ORDER)}
    rows.sort(key=lambda r: (r["tp"], r["placement"] != "node", r["cache"] != "cold", key.get(r["loader"], 99)))
    return rows


def _verdict(vs):
    vs = [v for v in vs if v is not None]
    if not vs:
        return "n/a"
    return "ok" if all(vs) else "MISMATCH"


def format_bytes(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _x(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _kib(n) -> str:
    return "-" if n is None else f"{n / 1024:.0f}"


def table(rows: list[dict]) -> str:
    head = ("loader", "tp", "placement", "cache", "wall s med [min-max]", "e2e s", "GB/s", "CPU s", "pulled GB",
            "req KiB", "procs' rb GB", "need GB (pages)", "amp", "rank amp", "RSS/rank GB", "USS/rank GB",
            "anon+/rank GB",
            "shard/rank GB", "x naive", "x raw", "check")
    lines = [head]
    for r in rows:
        lines.append((
            r["loader"], str(r["tp"]), r["placement"], r["cache"],
            f"{r['wall_s']:.2f} [{r['wall_min_s']:.2f}-{r['wall_max_s']:.2f}]",
            _x(r["e2e_s"]), _x(r["gbps"]), _x(r["cpu_s"], 1), format_bytes(r["pulled_bytes"]),
            _kib(r["mean_request_bytes"]), format_bytes(r["procs_read_bytes"]),
            f"{format_bytes(r['need_exact_bytes'])} ({format_bytes(r['need_pages_bytes'])})",
            _x(r["amp"]), _x(r["amp_rank_max"]), format_bytes(r["peak_rss_per_rank"]), format_bytes(r["peak_uss_per_rank"]),
            format_bytes(r["peak_anon_extra_per_rank"]), format_bytes(r["shard_bytes_per_rank"]),
            _x(r["wall_vs_naive"]), _x(r["wall_vs_raw"]), r["verified"],
        ))
    widths = [max(len(l[i]) for l in lines) for i in range(len(head))]
    out = []
    for n, l in enumerate(lines):
        out.append("  ".join(c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(l, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def markdown(rows: list[dict], select=None) -> str:
    """A Markdown table of the headline columns (rows filtered by `select`)."""
    head = ["loader", "tp", "placement", "cache", "wall s (median [min-max])", "e2e s", "CPU s",
            "pulled GB", "req KiB", "procs' rb GB", "amp", "rank amp", "private GB/rank", "- shard MB", "USS GB/rank",
            "x naive", "x raw", "check"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if select and not select(r):
            continue
        out.append("| " + " | ".join([
            r["loader"], str(r["tp"]), r["placement"], r["cache"],
            f"{r['wall_s']:.2f} [{r['wall_min_s']:.2f}-{r['wall_max_s']:.2f}]", _x(r["e2e_s"]), _x(r["cpu_s"], 1),
            format_bytes(r["pulled_bytes"]), _kib(r["mean_request_bytes"]), format_bytes(r["procs_read_bytes"]),
            _x(r["amp"]), _x(r["amp_rank_max"]), format_bytes(r["peak_anon_extra_per_rank"]),
            f"{r['private_over_shard_per_rank'] / 1e6:.0f}", format_bytes(r["peak_uss_per_rank"]),
            _x(r["wall_vs_naive"]), _x(r["wall_vs_raw"]), r["verified"],
        ]) + " |")
    return "\n".join(out)


def write(out_dir: str, rows: list[dict], records: list[dict], env: dict) -> dict[str, str]:
    paths = {"json": os.path.join(out_dir, "results.json"), "csv": os.path.join(out_dir, "results.csv"),
             "md": os.path.join(out_dir, "results.md")}
    with open(paths["json"], "w") as fh:
        json.dump({"environment": env, "rows": rows, "records": records}, fh, indent=1)
    with open(paths["csv"], "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    with open(paths["md"], "w") as fh:
        fh.write(markdown(rows) + "\n")
    return paths


def chart(rows: list[dict], path: str, title: str = "") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = []
    for r in rows:
        s = scenario(r)
        if s not in scen:
            scen.append(s)
    loaders = [l for l in LOADER_ORDER if any(r["loader"] == l for r in rows)]
    fig, axes = plt.subplots(4, 1, figsize=(max(10, 1.4 * len(scen) + 3), 15), sharex=True)
    width = 0.8 / len(loaders)
    by = {(scenario(r), r["loader"]): r for r in rows}

    def bars(ax, value, ylabel, err=False, log=False):
        for j, l in enumerate(loaders):
            xs, ys, lo, hi = [], [], [], []
            for i, s in enumerate(scen):
                r = by.get((s, l))
                v = value(r) if r else None
                if v is None:
                    continue
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(v)
                if err:
                    lo.append(v - r["wall_min_s"])
                    hi.append(r["wall_max_s"] - v)
            ax.bar(xs, ys, width, color=COLORS.get(l), label=l, yerr=[lo, hi] if err and xs else None,
                   capsize=2, error_kw={"lw": 0.8})
            if err and l.startswith("raylazy"):
                e2e = [(x, by[(s, l)]["e2e_s"]) for x, s in zip(xs, [s for s in scen if (s, l) in by])]
                ax.scatter([x for x, _ in e2e], [y for _, y in e2e], marker="_", s=120, color="black",
                           zorder=3, label="raylazy end to end" if l == "raylazy-ranged" else None)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)

    bars(axes[0], lambda r: r["wall_s"], "wall s (median, min-max)\nraylazy bars: reading in actors,\n black dash: end to end", err=True)
    axes[0].legend(ncol=4, fontsize=8)
    bars(axes[1], lambda r: r["cpu_s"], "CPU s, all ranks")
    bars(axes[2], lambda r: r["amp"] if r["cache"] == "cold" else None,
         "pulled from storage /\npage-rounded needed (cold)")
    axes[2].axhline(1.0, color="black", lw=0.8, ls="--")
    bars(axes[3], lambda r: r["peak_anon_extra_per_rank"] / 1e9, "peak private (anon) GB\nper rank above start")
    for i, s in enumerate(scen):
        shard = max((r["shard_bytes_per_rank"] for r in rows if scenario(r) == s), default=0) / 1e9
        axes[3].plot([i - 0.4, i + 0.4], [shard, shard], color="black", lw=1, ls=":")
    axes[3].set_xticks(range(len(scen)))
    axes[3].set_xticklabels(scen, rotation=20, ha="right")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
