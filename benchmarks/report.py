"""Ratios (ours vs each peer) and the printed table. Every ratio is a speedup: above 1 means ours is better."""

from __future__ import annotations

import math

LABELS = {
    "ours": "llamascope Engine",
    "hf_generate": "HF generate",
    "hf_forward_loop": "HF forward loop",
    "hf_sequential": "HF one-at-a-time",
    "hf_batched": "HF batched (padded)",
}


def _div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or not (math.isfinite(a) and math.isfinite(b)):
        return None
    return a / b


def compare(single: dict, conc: dict) -> dict:
    """single / conc: the summaries in the results JSON -> {phase: {peer: {metric: speedup}}}."""
    s0, c0 = single["ours"], conc["ours"]
    peers_single = [k for k in LABELS if k in single and k != "ours"]
    peers_conc = [k for k in LABELS if k in conc and k != "ours"]
    return {
        "single_stream": {
            k: {"decode_speedup": _div(s0["decode_tok_s"], single[k]["decode_tok_s"]),
                "ttft_speedup": _div(single[k]["ttft_s"], s0["ttft_s"])}
            for k in peers_single
        },
        "concurrent": {
            k: {"throughput_speedup": _div(c0["throughput_tok_s"], conc[k]["throughput_tok_s"]),
                "ttft_p50_speedup": _div(conc[k]["ttft_p50_s"], c0["ttft_p50_s"]),
                "ttft_p99_speedup": _div(conc[k]["ttft_p99_s"], c0["ttft_p99_s"])}
            for k in peers_conc
        },
    }


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}"


def print_report(r: dict) -> None:
    m, mach, w = r["model"], r["machine"], r["workload"]
    where = mach.get("device_name") or mach["cpu_model"]
    print(f"\n{m['name']}  {m['dtype']}  {m['device']} ({where}), {mach['threads']} threads, "
          f"torch {mach['torch_version']}, transformers {mach['transformers_version']}"
          + ("  [--quick]" if r["quick"] else ""))

    ws, ratios = w["single_stream"], r["ratios"]
    single = r["single_stream"]
    print(f"\nSingle stream: {ws['prompt_tokens']}-token prompt, {ws['new_tokens']} new tokens, greedy")
    print(f"  {'':22}{'TTFT ms':>9}{'decode tok/s':>14}{'total s':>9}{'ours decode':>13}{'ours TTFT':>11}  tokens")
    for k in (k for k in LABELS if k in single):
        v = single[k]
        rat = ratios["single_stream"].get(k, {})
        same = "" if k == "ours" else ("== ours" if single["tokens_match"][k]["equal"]
                                       else f"differ at {single['tokens_match'][k]['first_mismatch']}")
        print(f"  {LABELS[k]:22}{_ms(v['ttft_s']):>9}{v['decode_tok_s']:>14.1f}{v['total_s']:>9.2f}"
              f"{_x(rat.get('decode_speedup')) if k != 'ours' else '':>13}"
              f"{_x(rat.get('ttft_speedup')) if k != 'ours' else '':>11}  {same}")

    wc, conc = w["concurrent"], r["concurrent"]
    print(f"\nConcurrent: {wc['num_requests']} requests at t=0, prompts {wc['prompt_len_range'][0]}-"
          f"{wc['prompt_len_range'][1]} tokens ({wc['prompt']}), {wc['new_tokens']} new tokens each")
    print(f"  {'':22}{'out tok/s':>10}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'wall s':>9}{'ours tok/s':>12}  note")
    for k in (k for k in LABELS if k in conc):
        v = conc[k]
        rat = ratios["concurrent"].get(k, {})
        note = ""
        if v.get("extrapolated"):
            note = f"{v['measured_requests']} of {v['num_requests']} run, rest extrapolated"
        elif k == "ours":
            note = f"{v['engine_steps']} steps, {v['preemptions']} preemptions, {v['prefix_cache_hit_tokens']} cached"
        print(f"  {LABELS[k]:22}{v['throughput_tok_s']:>10.1f}{_ms(v['ttft_p50_s']):>13}{_ms(v['ttft_p99_s']):>13}"
              f"{v['wall_s']:>9.2f}{_x(rat.get('throughput_speedup')) if k != 'ours' else '':>12}  {note}")

    c = r.get("ceilings")
    if c:
        cw = c["concurrent_workload"]
        print(f"\nCeilings (matmuls alone, {c['matmul_gflop_per_token']:.2f} GFLOP/token): batch-1 decode "
              f"{c['decode_matmul_ms_per_token']:.1f} ms/token = {c['decode_ceiling_tok_s']:.1f} tok/s "
              f"({c['decode_weight_read_gb_s']:.1f} GB/s of weights); {c['prefill_rows']}-token steps "
              f"{c['prefill_matmul_gflop_s']:.0f} GFLOP/s = {c['prefill_ceiling_tok_s']:.0f} tok/s; the concurrent "
              f"workload's {cw['matmul_gflop']:.0f} GFLOP bound it at {cw['ceiling_tok_s']:.1f} output tok/s")

    mem = r["memory"]
    serve = mem["ours_serve"]
    print(f"\nMemory (ours): weights {mem['weights_mb']:.0f} MB, KV pool {mem['kv_pool_mb']:.0f} MB "
          f"({mem['kv_bytes_per_token']:.0f} B/token, {mem['kv_pool_tokens']} tokens); baseline RSS "
          f"(interpreter + torch, no model) {mem['baseline_rss_mb']:.0f} MB")
    cum = " (cumulative)" if serve["peak_is_cumulative"] else ""
    if "cuda_peak_allocated_mb" in serve:
        print(f"  serving peak CUDA allocated {serve['cuda_peak_allocated_mb']:.0f} MB = weights + KV pool + "
              f"{mem['ours_serve_overhead_mb']:.0f} MB; serving peak RSS{cum} {serve['peak_rss_mb']:.0f} MB")
    else:
        print(f"  serving peak RSS{cum} {serve['peak_rss_mb']:.0f} MB = weights + KV pool + "
              f"{mem['ours_serve_overhead_mb']:.0f} MB (of which the baseline {mem['baseline_rss_mb']:.0f} MB); "
              f"load peak RSS {mem['ours_load']['peak_rss_mb']:.0f} MB")
    if "hf_serve" in mem:
        print(f"  transformers: RSS before load {mem['hf_rss_before_load_mb']:.0f} MB, "
              f"serving peak RSS {mem['hf_serve']['peak_rss_mb']:.0f} MB")
