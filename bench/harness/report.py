"""Markdown tables and PNG charts from a results directory.

    python3 -m harness.report bench/results/DATE        # rewrites DATE/report.md + *.png
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from .scenarios import SCENARIOS

ORDER = list(SCENARIOS)
TOOL_ORDER = ["meshfs", "meshfs-mount", "rsync-ssh", "rsyncd", "syncthing", "syncthing-1s", "unison",
              "wire-copy", "wire-copy-tcp"]
# Not contenders: what a plain copy over meshfs's transport (wire-copy), or over TCP with the same
# identities (wire-copy-tcp), does at best (bench/README.md, "Tools"). Left out of "fastest" and
# "best other"; meshfs's rows give their ratio to wire-copy.
FLOORS = {"wire-copy", "wire-copy-tcp"}


def load(results_dir: Path):
    recs = []
    p = results_dir / "results.jsonl"
    if p.exists():
        for line in p.read_text().splitlines():
            if line.strip():
                recs.append(json.loads(line))
    meta = {}
    if (results_dir / "meta.json").exists():
        meta = json.loads((results_dir / "meta.json").read_text())
    return recs, meta


def _tool_key(t):
    return (TOOL_ORDER.index(t) if t in TOOL_ORDER else 99, t)


def _fmt_s(v):
    if v is None:
        return "–"
    if v < 10:
        return f"{v:.2f}"
    if v < 100:
        return f"{v:.1f}"
    return f"{v:.0f}"


def _fmt_mb(b):
    if b is None:
        return "–"
    mb = b / 1e6
    return f"{mb:.2f}" if mb < 10 else (f"{mb:.1f}" if mb < 100 else f"{mb:,.0f}")


def summarize(recs):
    """{profile: {scenario: {tool: summary}}}"""
    out = {}
    groups = {}
    for r in recs:
        if r.get("kind") != "measurement" or r.get("prereq"):
            continue
        groups.setdefault((r["profile"], r["scenario"], r["tool"]), []).append(r)
    for (prof, scen, tool), rs in groups.items():
        ok = [r for r in rs if r.get("ok")]
        s = {"n": len(rs), "n_ok": len(ok), "errors": sorted({str(r.get("error")) for r in rs
                                                               if not r.get("ok") and r.get("error")}),
             "na": next((r["na"] for r in rs if r.get("na")), None), "note": rs[0].get("note", "")}
        if ok:
            walls = [r["wall_s"] for r in ok if r.get("wall_s") is not None]
            s["median"] = statistics.median(walls) if walls else None
            s["min"], s["max"] = (min(walls), max(walls)) if walls else (None, None)
            s["wire"] = statistics.median([r.get("wire_bytes") or 0 for r in ok])
            s["cpu"] = statistics.median([r.get("cpu_s") or 0 for r in ok])
            fwd = [r["fwd"] for r in ok if (r.get("fwd") or {}).get("wire_bytes")
                   and "queue_drop_wire_bytes" in r["fwd"]]
            if fwd:
                # Dropped at the forwarder's queue, against what it delivered: the share of the
                # bytes that had to be sent again.
                s["dropped_pct"] = statistics.median(
                    [100.0 * f["queue_drop_wire_bytes"] / f["wire_bytes"] for f in fwd])
            rss = [r.get("peak_rss_kb") for r in ok if r.get("peak_rss_kb")]
            s["rss_kb"] = max(rss) if rss else None
            s["verified"] = sum(1 for r in ok if r.get("verified"))
            meta = [sum(v.get("meta_diffs", 0) for v in (r.get("verify") or {}).values()) for r in ok]
            s["meta_diffs"] = max(meta) if meta else 0
            if scen == "latency":
                samples = [x for r in ok for x in r.get("samples_ms", [])]
                s["samples"] = samples
                s["p50"] = ok[0].get("p50_ms")
                s["p90"] = ok[0].get("p90_ms")
                s["n_samples"] = len(samples)
                s["latency_note"] = ok[0].get("na_note")
            writes = [r.get("write_s") for r in ok if r.get("write_s") is not None]
            if writes:
                s["write_median"] = statistics.median(writes)
            durable = [r["durable_s"] for r in ok if r.get("durable_s") is not None]
            if durable:
                s["durable_median"] = statistics.median(durable)
                s["durable_min"], s["durable_max"] = min(durable), max(durable)
            content = [r.get("content_s") for r in ok if r.get("content_s") is not None]
            if content:
                s["content_median"] = statistics.median(content)
            if per_gb_row(scen):
                s.update(cpu_per_gb(ok))
        out.setdefault(prof, {}).setdefault(scen, {})[tool] = s
    return out


def per_gb_row(scen):
    """Initial syncs (fan-out included): rows where CPU seconds per GB of dataset compare."""
    return scen.startswith("initial-") or scen.startswith("fanout")


def cpu_per_gb(ok):
    """Medians over the runs of CPU seconds per GB (10^9 bytes) of the dataset, from each
    record's `cpu_by_host`: the sender (host A: its daemon, or the one-shot clients), the
    receivers summed (the hosts verified as destinations) and each receiver alone."""
    send, recv, per = [], [], {}
    for r in ok:
        nbytes = (r.get("dataset") or {}).get("bytes")
        cbh = r.get("cpu_by_host")
        if not nbytes or cbh is None:
            continue
        gb = nbytes / 1e9
        dsts = sorted(r.get("verify") or {}) or sorted(h for h in cbh if h != "A")
        send.append((cbh.get("A") or 0.0) / gb)
        recv.append(sum(cbh.get(h) or 0.0 for h in dsts) / gb)
        for h in dsts:
            per.setdefault(h, []).append((cbh.get(h) or 0.0) / gb)
    if not send:
        return {}
    return {"cpu_gb_send": statistics.median(send), "cpu_gb_recv": statistics.median(recv),
            "cpu_gb_per_recv": {h: statistics.median(v) for h, v in sorted(per.items())}}


def _fmt_gb(s):
    """The sender's and the receivers' cells of CPU s per GB."""
    if s.get("cpu_gb_send") is None:
        return "–", "–"
    recv = f"{s['cpu_gb_recv']:.1f}"
    per = s.get("cpu_gb_per_recv") or {}
    if len(per) > 1:
        recv += " (" + ", ".join(f"{h} {v:.1f}" for h, v in per.items()) + ")"
    return f"{s['cpu_gb_send']:.1f}", recv


def _clean(msg, n=300):
    msg = " ".join(str(msg).split()).replace("|", "/")
    return msg if len(msg) <= n else msg[:n - 1] + "…"


def _metric(s, scen):
    if scen == "latency":
        return s.get("p50")
    return s.get("median")


def _ratio(tool, vals):
    """`tool`'s time in `vals` (tool: time) as a multiple of the fastest contender's, and for
    meshfs also of the best other tool's."""
    v = vals.get(tool)
    fastest = min((x for t, x in vals.items() if t not in FLOORS), default=None)
    if not v or not fastest:
        return "–"
    out = f"{v / fastest:.2f}×"
    best_other = min((x for t, x in vals.items()
                      if not t.startswith("meshfs") and t not in FLOORS), default=None)
    if tool.startswith("meshfs") and best_other:
        out += f" (vs best other {v / best_other:.2f}×)"
    return out


def table(prof, summ, meta):
    lines = []
    runs = meta.get("runs", "?")
    lines.append(f"| scenario | tool | time: median (min–max) | × fastest | to durable: median "
                 f"(min–max) | × fastest | wire MB | CPU s | "
                 f"CPU s/GB sender | CPU s/GB receivers | peak RSS MB | verified | notes |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for scen in ORDER:
        if scen not in summ:
            continue
        tools = summ[scen]
        vals = {t: _metric(s, scen) for t, s in tools.items() if _metric(s, scen)}
        # meshfs's floor is its own carriers' (D105): QUIC, and TCP for large fetches on a short
        # path; the faster of the two measured is the floor it is held to.
        # The same step timed until the destinations' data was also on disk (`sync -f` right
        # after the tool said it was done; see `ChainRun.make_durable`).
        dur = {t: s.get("durable_median") for t, s in tools.items()
               if s.get("durable_median") and scen != "latency"}
        floors = [(vals[t], t) for t in ("wire-copy", "wire-copy-tcp") if vals.get(t)]
        floor, floor_tool = min(floors) if floors else (None, None)
        for tool in sorted(tools, key=_tool_key):
            s = tools[tool]
            notes = []
            if s.get("na"):
                lines.append(f"| {scen} | {tool} | n/a | | | | | | | | | | {_clean(s['na'])} |")
                continue
            if s["n_ok"] == 0:
                err = _clean(s["errors"][0] if s["errors"] else "failed")
                lines.append(f"| {scen} | {tool} | **failed** | | | | | | | | | 0/{s['n']} | {err} |")
                continue
            if scen == "latency":
                t = f"p50 {s['p50']:.0f} ms, p90 {s['p90']:.0f} ms (n={s['n_samples']})"
                if s.get("latency_note"):
                    notes.append("rsync run right after each write")
            else:
                t = f"{_fmt_s(s['median'])} s ({_fmt_s(s['min'])}–{_fmt_s(s['max'])})"
            v = vals.get(tool)
            ratio = _ratio(tool, vals)
            d = dur.get(tool)
            t_d = "–"
            if d:
                t_d = f"{_fmt_s(d)} s ({_fmt_s(s['durable_min'])}–{_fmt_s(s['durable_max'])})"
            ratio_d = _ratio(tool, dur)
            if tool.startswith("meshfs") and v and floor:
                notes.append(f"{v / floor:.2f}× the transport's floor ({floor_tool})")
            if tool in FLOORS:
                notes.append("the transport's floor, not a contender")
            if s["n_ok"] < s["n"]:
                notes.append(f"{s['n_ok']}/{s['n']} runs ok: " + _clean("; ".join(s["errors"]), 200))
            if (s.get("content_median") is not None and scen not in ("latency", "nochange")
                    and s["content_median"] < s["median"] - 0.0005):
                notes.append(f"content complete at {_fmt_s(s['content_median'])} s")
            if s.get("write_median") is not None:
                notes.append(f"writing took {_fmt_s(s['write_median'])} s")
            if s.get("dropped_pct") is not None:
                notes.append(f"{s['dropped_pct']:.1f} % of the bytes dropped at the forwarder")
            if s.get("meta_diffs"):
                notes.append(f"{s['meta_diffs']} files differ in mode/mtime")
            rss = f"{s['rss_kb'] / 1024:.0f}" if s.get("rss_kb") else "–"
            gb_send, gb_recv = _fmt_gb(s)
            lines.append(f"| {scen} | {tool} | {t} | {ratio} | {t_d} | {ratio_d} | "
                         f"{_fmt_mb(s.get('wire'))} | "
                         f"{s.get('cpu', 0):.1f} | {gb_send} | {gb_recv} | {rss} | "
                         f"{s['verified']}/{s['n']} | "
                         f"{_clean('; '.join(notes), 400)} |")
    return "\n".join(lines)


def network_table(recs):
    nets = [r for r in recs if r.get("kind") == "network"]
    if not nets:
        return ""
    lines = ["| profile | ping RTT avg (min–max) | TCP (default cc) | TCP cubic | UDP 500M offered | "
             "UDP 900M offered | forwarder drops |",
             "|---|---|---|---|---|---|---|"]
    for n in nets:
        p = n.get("ping_ms", {})
        cc = n.get("tcp_cc_default", "?")
        tcp = n.get(f"tcp_{cc}", {})
        cub = n.get("tcp_cubic", tcp if cc == "cubic" else {})

        def udp(k):
            u = n.get(k, {})
            if "error" in u or not u:
                return u.get("error", "–")
            return f"{u.get('mbit_s')} Mbit/s, loss {u.get('lost_percent')} %"

        drops = [n.get(k, {}).get("forwarder", {}).get("queue_drops") for k in
                 (f"tcp_{cc}", "tcp_cubic", "udp_500M", "udp_900M")]
        drops_s = ", ".join("–" if d is None else str(d) for d in drops) \
            if any(d is not None for d in drops) else "n/a (no forwarder)"
        lines.append(f"| {n['profile']} | {p.get('avg', '–')} ms ({p.get('min', '–')}–"
                     f"{p.get('max', '–')}) | {tcp.get('mbit_s', '–')} Mbit/s ({cc}) | "
                     f"{cub.get('mbit_s', '–')} Mbit/s | {udp('udp_500M')} | {udp('udp_900M')} | "
                     f"{drops_s} |")
    return "\n".join(lines)


def charts(results_dir: Path, summ):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    for prof, by_scen in summ.items():
        scens = [s for s in ORDER if s in by_scen and s != "latency"]
        if scens:
            cols = 3
            rows = (len(scens) + cols - 1) // cols
            fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
            for ax in axes.flat[len(scens):]:
                ax.axis("off")
            for ax, scen in zip(axes.flat, scens):
                tools = sorted(by_scen[scen], key=_tool_key)
                med, lo, hi, labels, colors = [], [], [], [], []
                for t in tools:
                    s = by_scen[scen][t]
                    if s.get("median") is None:
                        continue
                    labels.append(t)
                    med.append(s["median"])
                    lo.append(s["median"] - s["min"])
                    hi.append(s["max"] - s["median"])
                    colors.append("tab:red" if t == "meshfs" else "tab:blue")
                if not med:
                    ax.set_title(f"{scen}: no successful runs", fontsize=9)
                    ax.axis("off")
                    continue
                y = range(len(med))
                ax.barh(list(y), med, xerr=[lo, hi], color=colors, capsize=3)
                ax.set_yticks(list(y))
                ax.set_yticklabels(labels, fontsize=8)
                ax.invert_yaxis()
                ax.set_title(scen, fontsize=10)
                ax.set_xlabel("seconds (median, min–max)", fontsize=8)
                for i, v in enumerate(med):
                    ax.text(v, i, f" {_fmt_s(v)}", va="center", fontsize=7)
            fig.suptitle(f"meshfs bench — {prof} — wall time (lower is better)")
            fig.tight_layout()
            f = results_dir / f"times-{prof}.png"
            fig.savefig(f, dpi=110)
            plt.close(fig)
            files.append(f.name)
        if "latency" in by_scen:
            lat = {t: s for t, s in by_scen["latency"].items() if s.get("samples")}
            if lat:
                tools = sorted(lat, key=_tool_key)
                fig, ax = plt.subplots(figsize=(7, 0.6 * len(tools) + 1.5))
                ax.boxplot([lat[t]["samples"] for t in tools], vert=False, labels=tools,
                           whis=(10, 90), showfliers=True)
                ax.set_xscale("log")
                ax.set_xlabel("ms from write on A to correct content on B (log)")
                ax.set_title(f"propagation latency — {prof} (box: quartiles, whiskers p10–p90)")
                fig.tight_layout()
                f = results_dir / f"latency-{prof}.png"
                fig.savefig(f, dpi=110)
                plt.close(fig)
                files.append(f.name)
    return files


def write_report(results_dir: Path):
    results_dir = Path(results_dir)
    recs, meta = load(results_dir)
    summ = summarize(recs)
    v = meta.get("versions", {})
    out = [f"# meshfs benchmark — {meta.get('date', results_dir.name)}", ""]
    out.append(f"Machine: {v.get('cpu', '?')}, {v.get('mem_gib', '?')} GiB RAM, "
               f"{v.get('os', '?')}, kernel {v.get('kernel', '?')}. "
               f"Runs per measurement: {meta.get('runs', '?')}"
               f"{' (quick mode: small datasets)' if meta.get('quick') else ''}; "
               f"page cache dropped before initial syncs and the no-change re-sync: "
               f"{'yes' if meta.get('drop_caches') else 'no'}.")
    out.append("")
    out.append("Tools: " + "; ".join(f"{k}: {v.get(k)}" for k in
                                     ("meshfs", "rsync", "ssh", "syncthing", "unison")))
    out.append("")
    if meta.get("datasets"):
        out.append("Datasets: " + "; ".join(f"{n}: {d['description']} ({d['files']:,} files, "
                                            f"{d['bytes'] / 1e6:,.1f} MB)"
                                            for n, d in meta["datasets"].items()))
        out.append("")
    nt = network_table(recs)
    if nt:
        out += ["## Network check", "", nt, ""]
    for prof in ("lan", "wan"):
        if prof not in summ:
            continue
        out += [f"## {prof}", "", table(prof, summ[prof], meta), ""]
    pngs = charts(results_dir, summ)
    if pngs:
        out += ["Charts: " + ", ".join(pngs), ""]
    md = "\n".join(out)
    (results_dir / "report.md").write_text(md)
    return md


if __name__ == "__main__":
    print(write_report(Path(sys.argv[1])))
