"""The "gpu" section of the study's README.md, from one benchmark JSON file."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.harness import report
from benchmarks.harness.timing import fmt_ratio as _r  # "median (min–max)"


def _p(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n / 1e3:.1f}k"


def write_report(path: Path, results_md: Path) -> Path:
    """The "gpu" section of ``results_md`` (the study's README.md) from one JSON file; the reading is kept."""
    data = json.loads(path.read_text())
    meta, cases = data["meta"], data["cases"]
    out = ["## GPU", ""]
    if meta["backend"] == "cpu":
        out += [
            f"> **These are CPU smoke numbers** ({meta['device']}, tiny shapes): no GPU was available in the "
            "session that made them. They show that every case runs end to end; they say nothing about "
            "accelerator performance. Run `python -m benchmarks.gpu --out benchmarks/gpu/gpu_h100.json` on a GPU "
            "and `--report` that file to replace this section.",
            "",
        ]
    out += [
        f"Device: **{meta['device']}**, JAX {meta['jax']}, host {meta['host']}, {meta['date']}; the run "
        f"took {sum(meta['wall_s'].values()):.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in meta["wall_s"].items())
        + ").",
        "",
        "Commands:",
        "",
        f"- `{meta['command'].strip()}`",
        f"- `python -m benchmarks.gpu --report {path}` (this section)",
        "",
        "Each variant compiled once"
        + (" (a case's variants concurrently, on this CPU)" if meta.get("concurrent_compile") else "")
        + f" and warmed up; alternating blocks over "
        f"{meta['rounds']} rounds; ratio = block time / baseline block time of the same round, median "
        "(min–max). Absolute times are medians per step.",
        "",
        report.kept_reading(results_md, "gpu"),
        "",
    ]
    out += _update_table(cases.get("update"))
    out += _micro_table(
        "LM step: GPT-like decoder, 8 micro-batches in one step",
        cases.get("lm"),
        ("adascale", "delayed"),
        "sgd (scan, mean)",
    )
    out += _micro_table(
        "LM step: 8 replicas as a vmap axis on one device", cases.get("lm_vmap"), ("floor", "adascale"), "sgd + pmean"
    )
    out += _micro_table("ResNet-18-like CNN step, 8 micro-batches", cases.get("cnn"), ("adascale", "delayed"), "sgd")
    out += _peer_table(cases.get("peer"))
    out += _profile_table(cases.get("profile"))
    if meta.get("errors"):
        out += ["", "Errors: " + "; ".join(f"{k}: {v}" for k, v in meta["errors"].items())]
    return report.write_section(results_md, "gpu", "\n".join(out))


def _missing(title: str, res: dict | None) -> list[str] | None:
    if res is None:
        return [f"### {title}", "", "_(not run)_", ""]
    if "error" in res:
        return [f"### {title}", "", f"_(failed: {res['error']})_", ""]
    return None


def _update_table(res):
    title = "Update only: flat f32 parameters, momentum 0.9, donated, MicrobatchStats(k=8)"
    if (m := _missing(title, res)) is not None:
        return m
    bm = res["bytes_model"]
    out = [
        f"### {title}",
        "",
        f"Bandwidth model: SGD moves {bm['sgd_words_per_param']} words per parameter ({bm['sgd_words']}); "
        "every variant is charged those 5 words, so an extra pass shows as lower GB/s. The copy "
        "(`x * 1.0` in place on a donated buffer of the same leaves, 1.0 given at run time, timed in the "
        f"same rounds) moves {bm['copy_words_per_element']} words per element.",
        "",
        "| params (leaves) | sgd ms | floor | **adascale** | delayed | copy ms | copy GB/s | sgd GB/s (% copy) "
        "| adascale GB/s (% copy) | delayed GB/s (% copy) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in res["rows"]:
        r, gb, fr, ms = row["ratios"], row["achieved_GBps"], row["fraction_of_copy_bandwidth"], row["median_ms"]
        bw = lambda v, gb=gb, fr=fr: f"{gb[v]:.1f} ({100 * fr[v]:.0f} %)" if v in gb else "–"  # noqa: E731
        rr = lambda v, r=r: _r(r[v]) if v in r else "–"  # noqa: E731
        out.append(
            f"| {_p(row['params'])} ({row['leaves']}) | {ms['sgd']:.3f} | {rr('floor')} | "
            f"**{rr('adascale')}** | {rr('delayed')} | {ms['copy']:.3f} | {gb['copy']:.1f} | "
            f"{bw('sgd')} | {bw('adascale')} | {bw('delayed')} |"
        )
    return out + [""]


def _micro_table(title, res, variants, base_label):
    if (m := _missing(title, res)) is not None:
        return m
    cfg = res["config"]
    shape = ", ".join(f"{k} {v}" for k, v in cfg.items())
    out = [
        f"### {title}",
        "",
        f"Config: {shape}; {_p(res['params'])} params"
        + (f"; {res['tokens_per_step']} tokens per step" if "tokens_per_step" in res else "")
        + (
            f"; {res['replicas']} replicas of {res['per_replica_batch']} sequences, {res['remat']}"
            if "replicas" in res
            else ""
        )
        + ".",
        "",
        f"| {base_label} ms | " + " | ".join(f"{v}" for v in variants) + " | steps/block | compile s |",
        "|---:|" + "---:|" * len(variants) + "---:|---|",
        f"| {res['median_ms'][res['baseline']]:.2f} | "
        + " | ".join(_r(res["ratios"][v]) if v in res["ratios"] else "–" for v in variants)
        + f" | {res['steps_per_block']} | "
        + ", ".join(f"{k} {v:.1f}" for k, v in res["compile_s"].items())
        + " |",
        "",
    ]
    return out


def _peer_table(res):
    title = "FairScale peer: AdaScale(SGD) vs torch SGD, 8-step gradient accumulation"
    if res is None or "skipped" in res:
        reason = "not run" if res is None else res["skipped"]
        return [f"### {title}", "", f"_(skipped: {reason})_", ""]
    if (m := _missing(title, res)) is not None:
        return m
    r = res["ratios"]["adascale"]
    return [
        f"### {title}",
        "",
        f"torch {res['torch']}, fairscale {res['fairscale']}, on {res['device']}; the LM shape of the JAX case "
        f"({_p(res['params'])} params, {res['tokens_per_step']} tokens per step, bf16 autocast). "
        "FairScale reads ‖ḡ‖² on the host (`.item()` per parameter) after the 8th backward.",
        "",
        "| torch SGD ms | FairScale AdaScale ms | **AdaScale / SGD** |",
        "|---:|---:|---:|",
        f"| {res['median_ms']['sgd']:.1f} | {res['median_ms']['adascale']:.1f} | **{_r(r)}** |",
        "",
    ]


def _profile_table(res):
    title = "Top costs of the AdaScale update in the compiled LM step"
    if (m := _missing(title, res)) is not None:
        return m
    w = res["total_bytes_in_param_words"]
    progs = res["programs"]
    out = [
        f"### {title}",
        "",
        "The LM step's entry computation without its micro-batch loop (the forward and backward passes): "
        "the update, the final 1/k of the accumulated gradient, the accumulators' zeroing. Bytes per "
        f"instruction = result + operand sizes read off the HLO text ({_p(res['params'])} params). "
        f"Total bytes over 4 × params: **SGD {w['sgd']:.2f}, AdaScale {w['adascale']:.2f}** "
        f"({progs['sgd']['instructions']} and {progs['adascale']['instructions']} instructions). "
        "The per-micro-batch squared norms run inside the loop and are not counted here.",
        "",
        "| MB | instruction | op | kind | result | scope |",
        "|---:|---|---|---|---|---|",
    ]
    for r in progs["adascale"]["top"]:
        out.append(
            f"| {r['bytes'] / 1e6:.2f} | `{r['name']}` | {r['op']} | {r['kind']} | `{r['result']}` | {r['scope']} |"
        )
    out += [
        "",
        "Bytes by scope (MB), AdaScale step: "
        + ", ".join(
            f"{k} {v / 1e6:.2f}" for k, v in sorted(progs["adascale"]["bytes_by_scope"].items(), key=lambda kv: -kv[1])
        ),
    ]
    return out + [""]
