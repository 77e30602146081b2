"""The dashboard's plotly figures. plotly is imported lazily: only `attnbench report` needs it."""

from __future__ import annotations

import pandas as pd

from attnbench.compare import geomean

_MODES = ("fwd", "bwd", "fwd+bwd")
_CONFIG = {"displaylogo": False, "responsive": True}


def _go():
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "attnbench report needs plotly: pip install 'attnbench[report]'"
        ) from exc
    return go, make_subplots


def _colors(impls: list[str]) -> dict[str, str]:
    from plotly.colors import qualitative

    palette = qualitative.D3 + qualitative.Set2
    ordered = sorted(impls, key=lambda i: (i != "engine", i))  # engine always gets blue
    return {impl: palette[n % len(palette)] for n, impl in enumerate(ordered)}


def _mode_order(modes) -> list[str]:
    return sorted(set(modes), key=lambda m: (_MODES.index(m) if m in _MODES else 9, m))


NOISY = "noisy (not trusted)"  # legend name of the grey points of noisy rows
_GREY = "#a3a8b3"


def tflops_over_seqlen(rows: pd.DataFrame, title: str):
    """TFLOP/s of every implementation over sequence length, one panel per (config, mode);
    noisy rows are grey points outside the implementations' lines."""
    go, make_subplots = _go()
    ran = rows[rows["status"].isin(("ok", "noisy")) & rows["tflops"].notna()]
    if ran.empty:
        return None
    # Panels: rows = dtype/shape/head-dim combinations, columns = modes.
    ran = ran.assign(_panel=ran["dtype"].astype(str) + " " + ran["shape"].astype(str) + " D"
                     + ran["head_dim"].astype(str))
    ok, noisy = ran[ran["status"] == "ok"], ran[ran["status"] == "noisy"]
    panels = sorted(ran["_panel"].unique())
    modes = _mode_order(ran["mode"])
    fig = make_subplots(rows=len(panels), cols=len(modes), shared_xaxes=True,
                        subplot_titles=[f"{p} {m}" for p in panels for m in modes],
                        vertical_spacing=min(0.12, 0.3 / max(1, len(panels))))
    colors = _colors(sorted(ok["impl"].unique()))
    seen: set[str] = set()
    for r, panel in enumerate(panels, start=1):
        for c, mode in enumerate(modes, start=1):
            sub = ok[(ok["_panel"] == panel) & (ok["mode"] == mode)]
            for impl, grp in sorted(sub.groupby("impl"), key=lambda kv: (kv[0] != "engine",
                                                                         kv[0])):
                grp = grp.sort_values("seqlen_q")
                fig.add_trace(go.Scatter(
                    x=grp["seqlen_q"], y=grp["tflops"], mode="lines+markers", name=impl,
                    legendgroup=impl, showlegend=impl not in seen,
                    line={"color": colors[impl], "width": 3 if impl == "engine" else 1.8},
                    customdata=grp[["case", "latency_ms", "batch"]].to_numpy(),
                    hovertemplate=(f"{impl}<br>seqlen %{{x}}, batch %{{customdata[2]}}<br>"
                                   "%{y:.1f} TFLOP/s, %{customdata[1]:.3f} ms"
                                   "<br>%{customdata[0]}<extra></extra>"),
                ), row=r, col=c)
                seen.add(impl)
            grey = noisy[(noisy["_panel"] == panel) & (noisy["mode"] == mode)]
            if not grey.empty:
                fig.add_trace(_noisy_trace(go, grey, NOISY not in seen), row=r, col=c)
                seen.add(NOISY)
            fig.update_xaxes(type="log", title_text="sequence length" if r == len(panels)
                             else None, row=r, col=c)
            fig.update_yaxes(title_text="TFLOP/s" if c == 1 else None, rangemode="tozero",
                             row=r, col=c)
    fig.update_layout(title=title, height=260 + 260 * len(panels), template="plotly_white",
                      margin={"t": 70, "l": 60, "r": 20, "b": 50})
    return fig


def _noisy_trace(go, rows: pd.DataFrame, legend: bool):
    return go.Scatter(
        x=rows["seqlen_q"], y=rows["tflops"], mode="markers", name=NOISY, legendgroup=NOISY,
        showlegend=legend, marker={"color": _GREY, "symbol": "x", "size": 9},
        customdata=rows[["impl", "latency_ms", "latency_spread_ms", "case"]].to_numpy(),
        hovertemplate=("%{customdata[0]} (noisy)<br>seqlen %{x}: %{y:.1f} TFLOP/s, "
                       "%{customdata[1]:.3f} ± %{customdata[2]:.3f} ms<br>%{customdata[3]}"
                       "<extra></extra>"),
    )


def engine_speedup_bars(rows: pd.DataFrame, engine: str, title: str):
    """Geomean over cases of (other latency / engine latency), per variant and mode."""
    go, make_subplots = _go()
    ok = rows[rows["status"] == "ok"]
    lat = ok.pivot_table(index=["variant", "mode", "case"], columns="impl",
                         values="latency_ms", aggfunc="median")
    if engine not in lat.columns or lat.shape[1] < 2:
        return None
    others = [c for c in lat.columns if c != engine]
    modes = _mode_order(lat.index.get_level_values("mode"))
    fig = make_subplots(rows=1, cols=len(modes), subplot_titles=modes, shared_yaxes=True)
    colors = _colors([engine, *others])
    for c, mode in enumerate(modes, start=1):
        sub = lat.xs(mode, level="mode")
        variants = sorted(sub.index.get_level_values("variant").unique())
        for impl in others:
            ys = [geomean(sub.loc[v, impl] / sub.loc[v, engine]) for v in variants]
            fig.add_trace(go.Bar(x=variants, y=ys, name=f"vs {impl}", legendgroup=impl,
                                 showlegend=c == 1, marker_color=colors[impl],
                                 hovertemplate=f"{engine} vs {impl}: %{{y:.2f}}x<extra></extra>"),
                          row=1, col=c)
        fig.add_hline(y=1.0, line_dash="dot", line_color="#555", row=1, col=c)
    fig.update_yaxes(title_text="speedup (x)", type="log", row=1, col=1)
    fig.update_layout(title=title, barmode="group", height=420, template="plotly_white",
                      margin={"t": 70, "l": 60, "r": 20, "b": 50})
    return fig


def history(rows: pd.DataFrame, title: str):
    """Geomean TFLOP/s per implementation and mode over the committed runs, oldest first."""
    go, make_subplots = _go()
    ok = rows[(rows["status"] == "ok") & rows["tflops"].notna()]
    if ok.empty:
        return None
    runs = (ok.groupby("source")
            .agg(when=("timestamp", "max"), sha=("git_sha", "first"))
            .sort_values(["when"], na_position="first"))
    local = (set(ok.loc[ok["origin"] == "local", "source"]) if "origin" in ok
             else set())
    labels: dict[str, str] = {}
    for n, (source, r) in enumerate(runs.iterrows()):
        day = str(r["when"])[:10] if pd.notna(r["when"]) else "?"
        sha = str(r["sha"])[:7] if pd.notna(r["sha"]) else "?"
        label = f"{day} {sha}" + (" local" if source in local else "")
        labels[source] = label + ("" if label not in labels.values() else f" #{n}")
    modes = _mode_order(ok["mode"])
    fig = make_subplots(rows=1, cols=len(modes), subplot_titles=modes, shared_yaxes=True)
    colors = _colors(sorted(ok["impl"].unique()))
    order = list(runs.index)
    for c, mode in enumerate(modes, start=1):
        for impl, grp in sorted(ok[ok["mode"] == mode].groupby("impl")):
            per_run = grp.groupby("source")["tflops"].agg([geomean, "count"])
            per_run = per_run.reindex([s for s in order if s in per_run.index])
            fig.add_trace(go.Scatter(
                x=[labels[s] for s in per_run.index], y=per_run["geomean"],
                customdata=per_run["count"], mode="lines+markers", name=impl,
                legendgroup=impl, showlegend=c == 1, line={"color": colors[impl]},
                hovertemplate=f"{impl}: %{{y:.1f}} TFLOP/s over %{{customdata}} cases"
                              "<extra></extra>",
            ), row=1, col=c)
        fig.update_xaxes(type="category", categoryorder="array",
                         categoryarray=[labels[s] for s in order], row=1, col=c)
    fig.update_yaxes(title_text="geomean TFLOP/s", rangemode="tozero", row=1, col=1)
    fig.update_layout(title=title, height=380, template="plotly_white",
                      margin={"t": 70, "l": 60, "r": 20, "b": 70})
    return fig


def to_div(fig, div_id: str) -> str:
    """The figure as a <div> + script; plotly.js itself is inlined once by the page."""
    return ("<div class='plot'>" + fig.to_html(full_html=False, include_plotlyjs=False,
                                               div_id=div_id, config=_CONFIG) + "</div>")


def plotlyjs() -> str:
    """The plotly.js bundle shipped with the plotly package, for inlining (no CDN)."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()

