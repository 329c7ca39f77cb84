"""The GPU check's measurements of the primitives, each a function that returns its JSON part.

- :func:`copy_bandwidth`: the device's copy rate (bytes read and written per second over a
  large ``copy_``), the yardstick of every floor below.
- :func:`decode_steps`: the target's step through the backend the engine would run it with
  (on a GPU: :mod:`d3d.backends.cuda`, decode steps replayed from CUDA graphs) at 1 / 16 / 64
  rows after a cached context, a plain step (1 token a row) and a 16-token verify step, each
  against its bandwidth floor (weights a step reads + the rows' keys and values, over the copy
  rate). Rows are given their context by length alone (what the KV holds does not change the
  time). At one row it also times the step with the model's own forms and with the fused torch
  forms but no Triton kernel (:mod:`d3d.backends.cuda.kernels`), so a run says what each buys.
- :func:`drafter_rounds`: a drafter's block (16 tokens after a cached context) and its packed
  round of 8 branches (the chain of the draft being verified plus one block per branch, one
  forward through the cuda backend's packed drafter, :mod:`d3d.backends.cuda.drafter`, captured
  on a GPU; beside it the row-by-row :func:`d3d.worker.drafting.draft_branches`), for a drafter
  of the D3D-1.7B shape (Qwen3-1.7B's dimensions, its own layers) and one of the target's first
  31 layers; and the packed round again with SDPA's attention in place of the split kernel
  (whose bands let one graph serve every context), so a run says what the kernel costs.
- :func:`captured_equals_eager`: greedy decoding of rows through captured steps against the
  same steps run eagerly (on a CPU: the eager cuda step against the reference backend), token
  for token; and again with two targets capturing and decoding in two threads at once, as the
  engine's target and a drafter worker's thread do in one process; and the captured steps
  without the Triton kernels against those with them.
- :func:`memory_against_plan`: the device's peak allocation against ``d3d plan``'s count.

Timings are medians over repeats, the device synchronised around each call (a step's time is
what the engine waits for).

Letters: R rows, S cached context, B block (16).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoConfig, DynamicCache

from d3d.backends import choose
from d3d.backends.clock import Clock
from d3d.backends.cuda import CudaBackend, CudaTarget
from d3d.backends.cuda.drafter import PackedDrafter, PackedPlan
from d3d.backends.cuda.kv import MIN_CAPACITY, StaticKV
from d3d.backends.hf import trim_cache
from d3d.backends.reference import ReferenceBackend
from d3d.backends.sizes import kv_bytes_per_token
from d3d.backends.slabs import KvRow
from d3d.engine.calibration import median_seconds
from d3d.model.drafter import D3DDrafter
from d3d.model.memory import param_bytes
from d3d.model.meta import DrafterMeta
from d3d.model.shapes import random_model
from d3d.tools.plan import PlanSettings, make_plan
from d3d.worker.drafting import draft_branches
from d3d.worker.packed_check import verdict_of

BLOCK = 16


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The median time of ``fn`` in ms on the engine's clock for ``device`` (one untimed call
    first: :func:`d3d.engine.calibration.median_seconds`)."""
    fn()
    return round(1e3 * median_seconds(fn, Clock([device]), max(repeats, 1)), 4)


def build_model(config: dict, device: torch.device, dtype: torch.dtype, layers: int | None = None):
    """Random weights of ``config`` (``layers``: that many decoder layers), made on ``device``
    (:func:`d3d.model.shapes.random_model`)."""
    d = {k: v for k, v in config.items() if k != "layer_types"}  # rebuilt from the depth
    return random_model(AutoConfig.for_model(d.pop("model_type"), **d), device, dtype, layers)


RESIDUAL_SCALE = 0.01  # what each layer's attention and MLP add, against a random model's


@torch.no_grad()
def wide_margins(model, seed: int = 0) -> dict:
    """Give a random model wide greedy margins, in place, without changing what a step costs.

    A random model's next-token scores are nearly flat, so a greedy token is often a near-tie,
    and in bf16 a 16-token verify rounds differently from a 1-token step: the text a ``sync`` or
    ``async`` request decodes leaves the one its ``ar`` run recorded within a few dozen tokens,
    and the replay instrument, which proposes that recording, has nothing more to propose (on
    the CPU in bf16 the tiny check left it after 23 and 48 of 64 tokens). A trained target is
    confident on most tokens; this makes the random one so: each layer's attention and MLP
    write :data:`RESIDUAL_SCALE` of their output into the residual stream (``o_proj`` and
    ``down_proj`` scaled), so the final hidden state stays close to the current token's
    embedding, and the LM head's rows are the input embedding's, permuted (an untied head), so
    one next token scores about ``sqrt(hidden)`` times any other. Only values change, never a
    shape, a dtype or a kernel, so every timing is what it was. Returns what was done, for the
    JSON."""
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(RESIDUAL_SCALE)
        layer.mlp.down_proj.weight.mul_(RESIDUAL_SCALE)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == emb.data_ptr()
    if not tied:  # a tied head already scores the current token's own embedding highest
        perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed))
        head.copy_(emb.index_select(0, perm.to(emb.device)))
    return {"residual_scale": RESIDUAL_SCALE, "head": "tied" if tied else "embedding, permuted"}


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> dict:
    """Bytes read and written per second by ``copy_`` of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, repeats)
    return {"bytes": nbytes, "ms": ms, "bytes_per_s": round(2 * nbytes / (ms / 1e3))}


def step_read_bytes(model) -> int:
    """Weights a decode step reads: all of them but the input embedding's unread rows (a
    tied embedding is the LM head, read whole)."""
    emb = model.get_input_embeddings().weight
    tied = emb.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    return param_bytes(model) - (0 if tied else emb.numel() * emb.element_size())


@torch.inference_mode()
def decode_steps(
    model, rows: Sequence[int], context: int, repeats: int, bandwidth: float, graphs: bool
) -> dict:
    """Plain and verify steps at each row count, against their floors (module docstring)."""
    device = next(model.parameters()).device
    most = max(rows)
    backend = CudaBackend(graphs=graphs, trust=True)  # timed even if its sample disagreed
    budget = most * max(context + 2 * BLOCK, MIN_CAPACITY)  # a slot for every row
    target = backend.target(model, budget, rows=most, block=BLOCK)
    weights = step_read_bytes(model)
    per_token = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
    out: dict = {"backend": type(target).__name__, "context": context, "rows": {}}
    out["sample"] = backend.report(model)  # the load-time check against the reference
    for r in rows:
        opened = [row_after(target, context) for _ in range(r)]
        step = median_ms(lambda r=r, o=opened: target.forward(o, [[1]] * r), device, repeats)
        verify = median_ms(
            lambda r=r, o=opened: target.forward(o, [[1] * BLOCK] * r), device, repeats
        )
        floor = 1e3 * (weights + r * (context + 1) * per_token) / bandwidth
        floor_v = 1e3 * (weights + r * (context + BLOCK) * per_token) / bandwidth
        out["rows"][str(r)] = {
            "step_ms": step,
            "verify16_ms": verify,
            "step_floor_ms": round(floor, 4),
            "step_over_floor": round(step / floor, 3),
            "verify16_over_floor": round(verify / floor_v, 3),
            "verify16_over_step": round(verify / step, 3),
        }
        for row in opened:
            target.kv.close(row)
    one = out["rows"].get("1")
    if one and isinstance(target, CudaTarget):
        # what the fused forms buy (d3d.backends.cuda.fused): the step in the model's own forms;
        # what the Triton kernels buy (d3d.backends.cuda.kernels): the fused torch forms alone
        for name, over, forms in (
            ("unfused", "unfused_over_fused", {"fused": False}),
            ("torch_forms", "torch_forms_over_kernels", {"kernels": False}),
        ):
            ms = one_row_step_ms(model, budget // most, context, graphs, repeats, **forms)
            one[f"{name}_step_ms"], one[over] = ms, round(ms / one["step_ms"], 3)
    for r in rows:
        if one and r != 1:
            out["rows"][str(r)]["step_over_one_row"] = round(
                out["rows"][str(r)]["step_ms"] / one["step_ms"], 3
            )
    out["counts"] = dict(target.counts) if isinstance(target, CudaTarget) else {}
    out["kernels"] = kernels_taken(getattr(target, "step", None))
    out["read_bytes"] = weights
    out["kv_bytes_per_token"] = per_token
    return out


def one_row_step_ms(model, capacity: int, context: int, graphs: bool, repeats: int,
                    **forms: bool) -> float:  # fmt: skip
    """A 1-row plain step's median time after ``context`` tokens, through a target of its own
    built with ``forms`` (``fused`` / ``kernels`` of :class:`CudaTarget`)."""
    device = next(model.parameters()).device
    target = CudaTarget(model, StaticKV.shaped(model, capacity, 1), block=BLOCK, graphs=graphs,
                        **forms)  # fmt: skip
    row = row_after(target, context)
    return median_ms(lambda: target.forward([row], [[1]]), device, repeats)


def row_after(target: CudaTarget, context: int) -> KvRow:
    """A row of ``target`` holding ``context`` tokens by length (what its KV holds does not
    change a step's time), with room for a verify after them."""
    row = target.kv.open(context + BLOCK)
    target.kv.ensure(row, context)
    target.kv.commit(row, context)
    return row


def rows_equal(a: Sequence[list[int]], b: Sequence[list[int]]) -> int:
    """Rows whose greedy tokens are the same in ``a`` and ``b``."""
    return sum(x == y for x, y in zip(a, b, strict=True))


def kernels_taken(step) -> dict:
    """Which Triton kernels a :class:`~d3d.backends.cuda.forward.StaticForward` took (their
    samples agreed), layers of each."""
    k = getattr(step, "kernels", None)
    if k is None or k.module is None:
        return {"module": False}
    return {"module": True, "add_norm": k.add_norm, "qk_in": sum(k.qk_in),
            "silu_mul": sum(k.silu_mul), "attend": k.attend, "layers": len(k.qk_in)}  # fmt: skip


def d3d_1_7b_drafter(config: dict, device: torch.device, dtype: torch.dtype) -> D3DDrafter:
    """A random drafter of the D3D-1.7B shape (its own layers, embeddings and head)."""
    lm = build_model(config, device, dtype)
    depth = lm.config.num_hidden_layers
    meta = DrafterMeta(
        base="qwen3-1.7b-shape",
        layers=tuple(range(depth)),
        block_size=BLOCK,
        shared_embeddings=False,
        vocab_size=lm.config.vocab_size,
        target_layers=depth,
    )
    return D3DDrafter(lm, meta).eval()


@torch.inference_mode()
def drafter_rounds(drafter: D3DDrafter, context: int, repeats: int, branches: int = 8) -> dict:
    """A block and a packed round of ``branches`` branches after ``context`` cached tokens: the
    round through the cuda backend's packed drafter (:mod:`d3d.backends.cuda.drafter`:
    captured on a GPU, eager on a CPU) and, for comparison, the row-by-row forward; and
    the packed drafter's sample at load against the row-by-row drafter
    (:mod:`d3d.worker.packed_check`: where it disagrees, a worker drafts row by row)."""
    device = drafter.device
    CudaBackend().prepare_drafter(drafter.lm)  # its projections laid out, as the engine's are
    vocab = drafter.meta.vocab_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (context,), generator=gen).tolist()
    cache = DynamicCache()
    drafter.encode(ids, cache)
    chain = ids[:BLOCK]
    s = cache.get_seq_length()

    def row_by_row() -> None:
        draft_branches(
            drafter, cache, [s + k for k in range(branches)], chain[:branches], chain=chain
        )
        trim_cache(cache, len(chain))

    plan = PackedPlan(graphs=device.type == "cuda", rows=1, kv_tokens=context + 4 * MIN_CAPACITY)
    verdict = verdict_of(drafter, plan)
    packed = PackedDrafter(drafter, plan)
    row = packed.open(context)
    none = torch.zeros(1, 0, dtype=torch.long)
    packed.run([row], [ids], none, none)  # the context, read once
    visible = torch.tensor([[s + k for k in range(branches)]], device=device)
    anchors = torch.tensor([chain[:branches]], device=device)

    def packed_round() -> None:
        packed.run([row], [chain], visible, anchors)
        row.length = s  # the next round writes its chain over this one's

    packed_ms = median_ms(packed_round, device, repeats)
    out = {
        "layers": len(drafter.meta.layers),
        "block_ms": median_ms(lambda: drafter.block_scores(ids[-1], cache), device, repeats),
        f"packed_{branches}_branches_ms": packed_ms,
        f"row_by_row_{branches}_branches_ms": median_ms(row_by_row, device, repeats),
        "weight_bytes": param_bytes(drafter),
        "packed_steps": dict(packed.counts),
        "kernels": kernels_taken(packed.step.core),
        "packed_sample": dataclasses.asdict(verdict) | {"agrees": verdict.agrees},
    }
    core = packed.step.core
    if core.kernels.attend:  # the same round with SDPA's attention (a mask, n keys) instead,
        taken, runner = core.kernels, packed.runner  # in graphs of its own
        core.kernels = dataclasses.replace(taken, attend=False)
        packed.runner = type(runner)(packed.step)
        sdpa_ms = median_ms(packed_round, device, repeats)
        core.kernels, packed.runner = taken, runner
        out[f"packed_{branches}_branches_sdpa_ms"] = sdpa_ms
        out["sdpa_over_split"] = round(sdpa_ms / packed_ms, 3)
    packed.close(row)
    return out


@torch.inference_mode()
def greedy(target, prompts: Sequence[Sequence[int]], steps: int) -> list[list[int]]:
    """Each prompt's ``steps`` greedy tokens decoded together through ``target``'s steps."""
    rows = [target.kv.open(len(p) + steps + BLOCK) for p in prompts]
    logits = target.forward(rows, [list(p) for p in prompts], [[len(p) - 1] for p in prompts])
    for row, p in zip(rows, prompts, strict=True):
        target.kv.commit(row, len(p))
    out = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(steps - 1):
        logits = target.forward(rows, [[o[-1]] for o in out])
        for row, o, lg in zip(rows, out, logits, strict=True):
            target.kv.commit(row, 1)
            o.append(int(lg[-1].argmax()))
    for row in rows:
        target.kv.close(row)
    return out


def captured_equals_eager(model, rows: int, prompt: int, steps: int) -> dict:
    """Greedy tokens of ``rows`` rows through captured steps against eager ones (module
    docstring); ``model`` in float32. On a CPU the steps are rehearsed, each held to its
    graph's first (:mod:`d3d.backends.cuda.rehearsal`), against the reference backend."""
    device = next(model.parameters()).device
    CudaBackend().prepare(model)  # the projections laid out, as the engine's are
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (prompt + i,), generator=gen).tolist() for i in range(rows)]
    budget = rows * max(prompt + rows + steps + 2 * BLOCK, MIN_CAPACITY)
    on_gpu = device.type == "cuda"
    fast = CudaBackend(graphs=True).target(model, budget, rows=rows, block=BLOCK)
    slow = (choose("cuda", "cpu") if on_gpu else ReferenceBackend()).target(
        model, budget, rows=rows, block=BLOCK
    )
    a, b = greedy(fast, prompts, steps), greedy(slow, prompts, steps)
    # the same captured steps through the torch forms alone, no Triton kernel
    forms = CudaTarget(model, StaticKV.shaped(model, budget, rows), block=BLOCK, kernels=False)
    c = greedy(forms, prompts, steps)
    del forms
    pair = [CudaBackend(graphs=True).target(model, budget, rows=rows, block=BLOCK) for _ in "ab"]
    both = in_two_threads([lambda t=t: greedy(t, prompts, steps) for t in pair])
    return {
        "captured": on_gpu,
        "rehearsed": not on_gpu,  # graphs' rehearsal on a CPU (d3d.backends.cuda.rehearsal)
        "against": "eager cuda steps" if on_gpu else "the reference backend (no GPU: rehearsed)",
        "rows": rows,
        "steps": steps,
        "rows_equal": rows_equal(a, b),
        "graphs": fast.runner.captured if isinstance(fast, CudaTarget) else 0,
        "two_threads_rows_equal": [rows_equal(o, b) for o in both],
        "kernels": kernels_taken(getattr(fast, "step", None)),
        "torch_forms_rows_equal": rows_equal(a, c),
    }


def in_two_threads(calls: Sequence[Callable[[], list]]) -> list[list]:
    """Each call's result, the calls run at once in threads of their own (an error in one is
    raised here)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def memory_against_plan(config: dict, device: torch.device, dtype: torch.dtype, rows: int,
                        kv_tokens: int) -> dict:  # fmt: skip
    """The device's peak allocation so far against ``d3d plan``'s target count for ``rows``
    sequences of ``kv_tokens`` (None off a GPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "target.json"
        path.write_text(json.dumps(config))
        plan = make_plan(
            PlanSettings(
                target=str(path),
                dtype=str(dtype).removeprefix("torch."),
                batch=rows,
                max_kv_tokens=kv_tokens,
                block_size=BLOCK,
                device=str(device),
            )
        )
    t = plan.target
    predicted = t.weight_bytes + t.kv_bytes + t.workspace_bytes
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {
        "rows": rows,
        "kv_tokens_a_row": kv_tokens,
        "measured_peak_bytes": peak,
        "plan_target_bytes": predicted,
        "measured_over_plan": None if peak is None else round(peak / predicted, 3),
    }
