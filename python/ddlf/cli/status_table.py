"""The worker table of ``ddlf status`` and ``ddlf up``: one row per daemon, asked on its own connection."""

from __future__ import annotations

from typing import Any

from ..errors import AuthenticationError, DdlfError

TOKEN_HINT = "the token comes from DDLF_TOKEN, or from --config cluster.toml's token_file"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def status_rows(addresses: list[str], kw: dict[str, Any], timeout: float) -> list[dict[str, Any]]:
    """One row per address: what the daemon says about itself, or why it could not be asked. Each worker is
    asked on its own connection, so a dead one never hides (or delays) the others."""
    from ..cluster.cluster import Cluster
    from ..data import store
    from ..devices import describe

    rows: list[dict[str, Any]] = []
    for i, address in enumerate(addresses):
        row: dict[str, Any] = {"id": i, "address": address}
        try:
            c = Cluster([address], connect_timeout=timeout, timeout=timeout, **kw)
        except DdlfError as exc:
            row["error"] = getattr(exc, "reason", None) or str(exc)
            if isinstance(exc, AuthenticationError):
                row["state"] = "REFUSED"  # it is up: it refused this token
                row["error"] += f" ({TOKEN_HINT})"
            rows.append(row)
            continue
        try:
            st = c.status(timeout=timeout)[0]
            row.update(st)
            # the runs come with the status (the daemon answers it without its Python), busy or not
            serving = f"runs {', '.join(st['runs'])}; " if st.get("runs") else ""
            if st["running"]:
                row["contents"] = f"{serving}busy: {st['running']}"  # its Python is taken; do not queue behind it
            else:
                v, f, d = c.variables()[0], c.functions()[0], c.call(store.describe)[0]
                row["device"] = c.call(describe)[0]
                row["contents"] = f"{serving}{len(v)} vars, {len(f)} fns, " + (
                    ", ".join(f"{ds['key']} ({_size(ds['nbytes'])})" for ds in d) or "no datasets"
                )
        except DdlfError as exc:
            row["error"] = getattr(exc, "reason", None) or str(exc)
        finally:
            c.close()
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = ["id", "address", "version", "uptime", "memory", "device", "running", "contents"]
    lines = []
    for r in rows:
        if "error" in r:
            state = r.get("state", "DOWN")
            lines.append([str(r["id"]), r["address"], "-", "-", "-", "-", state, "see below"])
            continue
        up = r["uptime_s"]
        lines.append(
            [
                str(r["id"]),
                r["address"],
                r["version"],
                f"{up / 3600:.1f} h" if up >= 3600 else f"{up:.0f} s",
                _size(r["rss_bytes"]),
                r.get("device", "?"),  # "?": busy, its Python was not asked
                f"{r['running']} ({r['running_for_s']:.0f} s)" if r["running"] else "idle",
                r.get("contents", ""),
            ]
        )
    widths = [max(len(h), *(len(line[k]) for line in lines)) for k, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    # Why a worker could not be asked, whole, under the table (a cut message hides the part that says what to do).
    why = [f"{r['id']} {r['address']}: {r['error']}" for r in rows if "error" in r]
    return "\n".join([fmt.format(*head), *(fmt.format(*line) for line in lines), *why])
