"""The GPU check's JSON as the Markdown table docs/results.md keeps (``d3d.tools.gpu_check``
prints it at the end of a run; ``python -m d3d.tools.gpu_report FILE`` prints it again from a
saved JSON)."""

from __future__ import annotations

import json
import sys


def table(res: dict) -> str:
    """The JSON's headline figures as a Markdown table (the one docs/results.md keeps)."""
    lines = [
        f"{res.get('device')} {res.get('dtype')}, target {res.get('target')}, context "
        f"{res.get('context')}; copy bandwidth "
        f"{(res.get('bandwidth') or {}).get('bytes_per_s', 0) / 1e12:.2f} TB/s",
        "",
        "| what | measured | against | goal |",
        "|---|---:|---:|---|",
    ]
    dec = (res.get("decode") or {}).get("rows") or {}
    for r, row in dec.items():
        lines.append(
            f"| decode step, {r} row(s) | {row['step_ms']} ms | floor {row['step_floor_ms']} ms: "
            f"{row['step_over_floor']}x | {'<= 1.25x floor' if r == '1' else ''} |"
        )
        if r != "1" and "step_over_one_row" in row:
            goal = "<= 1.3x" if r == "16" else ""
            lines.append(f"| {r} rows / 1 row | {row['step_over_one_row']}x | | {goal} |")
    if "1" in dec:
        lines.append(
            f"| 16-token verify / decode step | {dec['1']['verify16_over_step']}x | | <= 1.2x |"
        )
    if "unfused_step_ms" in dec.get("1", {}):
        lines.append(
            f"| decode step, 1 row, the model's own forms (no fused norms, rotation, products) | "
            f"{dec['1']['unfused_step_ms']} ms | {dec['1']['unfused_over_fused']}x the fused | |"
        )
    if "torch_forms_step_ms" in dec.get("1", {}):
        k = (res.get("decode") or {}).get("kernels") or {}
        taken = (
            f"taken: add_norm {k.get('add_norm')}, attend {k.get('attend')}, qk_in "
            f"{k.get('qk_in')} and silu_mul {k.get('silu_mul')} of {k.get('layers')} layers"
            if k.get("module")
            else "no kernel taken"
        )
        lines.append(
            f"| decode step, 1 row, fused torch forms without the Triton kernels | "
            f"{dec['1']['torch_forms_step_ms']} ms | {dec['1']['torch_forms_over_kernels']}x "
            f"with them ({taken}) | |"
        )
    for how, prof in (res.get("profile") or {}).items():
        if how in ("eager", "graphs") and isinstance(prof, dict):
            kinds = ", ".join(f"{k} {v}" for k, v in prof["by_kind_us"].items())
            lines.append(
                f"| decode step, 1 row, {how}: kernel time / wall (profiler) | "
                f"{prof['kernel_us']} / {prof['wall_us']} us ({prof['launches']} launches) | "
                f"{kinds} | |"
            )
    for name, row in (res.get("drafters") or {}).items():
        if not isinstance(row, dict):  # {"skipped": ...}
            continue
        lines.append(
            f"| drafter {name}: block / packed 8 branches | {row['block_ms']} / "
            f"{row['packed_8_branches_ms']} ms | verify x{row.get('packed_8_over_verify16')} | "
            f"{'within one verify' if name == 'd3d_1_7b' else ''} |"
        )
        sample = row.get("packed_sample")
        if sample:
            why = f" ({sample['failed']})" if sample["failed"] else ""
            lines.append(
                f"| drafter {name}: packed blocks = row-by-row blocks (the sample at load) | "
                f"{sample['error']:.1e} relative{why} | {sample['tolerance']:.0e} | within "
                f"(else the worker drafts row by row) |"
            )
        if "sdpa_over_split" in row:
            lines.append(
                f"| drafter {name}: packed 8 branches with SDPA's attention, not the split "
                f"kernel | {row['packed_8_branches_sdpa_ms']} ms | {row['sdpa_over_split']}x "
                f"the split kernel's | |"
            )
    ex = res.get("exactness") or {}
    if "rows_equal" in ex:
        lines.append(
            f"| captured = eager, fp32 | {ex['rows_equal']} of {ex['rows']} rows | {ex['against']} "
            f"| 16 of 16 |"
        )
    if "two_threads_rows_equal" in ex:
        pair = " and ".join(str(n) for n in ex["two_threads_rows_equal"])
        lines.append(
            f"| captured in two threads at once = eager | {pair} of {ex['rows']} rows | "
            f"{ex['against']} | 16 of 16 each |"
        )
    if "torch_forms_rows_equal" in ex:
        lines.append(
            f"| captured through the Triton kernels = through the torch forms, fp32 | "
            f"{ex['torch_forms_rows_equal']} of {ex['rows']} rows | | |"
        )
    replays = sorted(k for k in res if k.startswith(("replay_", "shaped_replay_")))
    for key in replays:
        modes = (res[key] or {}).get("modes") or {}
        n = key.rsplit("_", 1)[1]
        shape = key.startswith("shaped")
        what = "replay (instrument)" + (", the D3D-1.7B shape's forwards" if shape else "")
        for mode in ("sync", "async"):
            r = modes.get(mode) or {}
            if r.get("speedup_vs_ar") is not None:
                goal = ">= 4x" if mode == "sync" and n == "1" else ""
                lines.append(
                    f"| {what} {mode}, {n} row(s): decoding (end to end) | "
                    f"{r.get('decode_speedup_vs_ar')}x ({r['speedup_vs_ar']}x) ar | "
                    f"accept {r.get('acceptance_length')}, matches ar {r.get('matches_ar')}, "
                    f"new shapes {r.get('new_shapes')} (graphs taken up front "
                    f"{res[key].get('captured_up_front')})"
                    + (f", the drafter's {r['drafter_new_shapes']}" if shape else "")
                    + f" | {goal} |"
                )
        most = {m: ((modes.get(m) or {}).get("syncs_per_decode_step") or {}).get("max")
                for m in ("ar", "sync", "async")}  # fmt: skip
        most = {m: v for m, v in most.items() if v is not None}
        if most:
            shown = (
                " / ".join(f"{v:g}" for v in most.values()) + " at most"
                if res.get("device") != "cpu"
                else "not measured (no CUDA)"
            )
            lines.append(
                f"| engine's host-device waits a decode step ({' / '.join(most)}), {n} row(s)"
                f"{', with the shape' if shape else ''} "
                f"| {shown} | sync also waits for each row's draft | ar, async: <= 1 |"
            )
    for name, pr in (res.get("projection") or {}).items():
        if isinstance(pr, dict) and "speedup_vs_ar" in pr:
            lines.append(
                f"| two GPUs projected, {name} | {pr['speedup_vs_ar']}x ar | paper "
                f"{pr['paper_speedup']}x | >= 6x |"
            )
    mem = res.get("memory") or {}
    if mem.get("plan_target_bytes"):
        got = mem.get("measured_peak_bytes")
        shown = f"{got / 2**30:.2f} GiB" if got else "not measured (no CUDA)"
        lines.append(
            f"| peak memory | {shown} | d3d plan {mem['plan_target_bytes'] / 2**30:.2f} GiB | |"
        )
    if res.get("errors"):
        lines.append("\nerrors: " + "; ".join(res["errors"]))
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(table(json.load(f)))
