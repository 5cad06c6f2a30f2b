"""Bitwise exactness of a candidate against the reference (a diff harness).

Both sides start from the same cloned cache state, whose every cell holds large seeded
noise, so a read of a cell the batch does not own shows up. Inputs are traffic-shaped:
`exact_rows` real prompts with lengths sampled from the trace, each prefilled alone, then
`exact_steps` greedy decode steps of all rows together, then SOLO_STEPS more of the first
row alone (batch-1 decode is a shape the tiers time, and a pass may special-case it); all
through the CUDA graphs when captured: the path that is timed is the path that is checked.
The candidate runs first, so it cannot read the reference's answer for the same inputs.

Compared with `torch.equal`: the logits of every prefill and decode step, the greedy token
streams, and the whole KV cache afterwards (K/V written outside the batch's cells, or
wrong, differ). Then two probes: the fast tier's layer subsets, its layers and none (a
candidate must honour `state.layers`), and a step re-run on a changed cache, whose output
must change exactly as the reference's does (results kept across calls are caught).

Tolerance mode (`close`; `exact` stays bitwise) judges a candidate that computes the same
function with another summation order. The yardstick is the reference itself run in a wider
dtype (float32 for bf16/fp16 models, float64 for float32 ones) on the same inputs and the
same token stream, with its own copy of the noisy cache: on every compared step the
candidate's logits must be no further from that wide run than `factor` times the
reference's own distance from it, plus `floor` times the largest wide logit (for a
reference that is already exact at its width):

    max|cand - wide| <= factor * max|ref - wide| + floor * max|wide|

and the greedy tokens must be identical. Where they are not (either mode), `token_divergence`
says at which step and row they first part and how close the choice was there: each side's
logit gap between the two tokens, the wide run's, and whether the reference's is a near tie
(`measure.near_tie`: among its top 8, within 2% of its top logit), the kind another summation order can flip on a random-weight
model. This is the FlashAttention tests' criterion (no
more error than the framework's own implementation of the same thing, against a more
precise one); a fixed atol/rtol on logits is not, since what a bf16 model's last-bit flips
grow into over its layers depends on the model. K/V in the candidate's own cells may then
differ by rounding; K/V anywhere else may not. The changed-cache probe fills every cell
with noise (scores in the thousands, where bf16 rounding alone moves the softmax), so in
this mode it only checks that the output changes with the cache.
"""

from __future__ import annotations

import torch

from engine_server.greedy import argmax
from engine_server.measure import NEAR_TIE_K, call, compare, near_tie, output, run_step
from engine_server.results import ExactResult, Mismatch, TokenDivergence
from engine_server.state import decode_batch, prefill_batch


def _noise(eng, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The whole cache filled with N(0, noise_scale), drawn on the device (same seed, same noise)."""
    g = torch.Generator(device=eng.device).manual_seed(seed)
    scale = eng.config.noise_scale

    def fill(ts):
        return [(torch.randn(t.shape, generator=g, device=t.device) * scale).to(t.dtype) for t in ts]
    return fill(eng.state.k_cache), fill(eng.state.v_cache)


def _first_diff(ref: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
    """(row, index) of the first differing element (NaN counts as differing)."""
    if out.shape != ref.shape:
        return 0, -1
    neq = (ref != out) | (ref.isnan() != out.isnan())
    idx = neq.flatten().nonzero()
    if len(idx) == 0:
        return -1, -1
    flat = idx[0].item()
    return flat // ref.shape[-1], flat % ref.shape[-1]


SOLO_STEPS = 2  # decode steps of the first row alone, after the rows' shared steps

# the dtype tolerance mode's yardstick runs in
WIDER = {torch.bfloat16: torch.float32, torch.float16: torch.float32, torch.float32: torch.float64}


class _Diff:
    def __init__(self, res: ExactResult, mode: str, factor: float, floor: float):
        self.res, self.mode, self.factor, self.floor = res, mode, factor, floor
        self.close = True

    def logits(self, phase: str, step: int, ref: torch.Tensor, out: torch.Tensor,
               wide: torch.Tensor | None = None) -> None:
        """Record how `out` differs from `ref`; in tolerance mode, judge it against `wide`
        (the reference at the wider dtype on the same inputs) when given."""
        if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            self.res.violations.append(f"{phase} step {step}: output {shape}, expected {tuple(ref.shape)}")
            self.close = False
            return
        if self.mode == "tolerance" and wide is not None:
            self._judge(ref, out, wide)
        if torch.equal(ref, out):
            return
        d = (ref.float() - out.float()).abs()
        m = d.max().item() if not d.isnan().any() else float("nan")
        self.res.max_abs_diff = m if m != m else max(self.res.max_abs_diff, m)
        if self.res.first_mismatch is None:
            row, i = _first_diff(ref, out)
            self.res.first_mismatch = Mismatch(phase=phase, step=step, row=row, index=i,
                                               reference=ref[row, i].item() if i >= 0 else 0.0,
                                               candidate=out[row, i].item() if i >= 0 else 0.0)

    def _judge(self, ref: torch.Tensor, out: torch.Tensor, wide: torch.Tensor) -> None:
        w = wide.double()
        e_c = (out.double() - w).abs().max().item()
        e_r = (ref.double() - w).abs().max().item()
        bound = self.factor * e_r + self.floor * w.abs().max().item()
        r = self.res
        r.candidate_error = e_c if e_c != e_c else max(r.candidate_error or 0.0, e_c)
        r.reference_error = max(r.reference_error or 0.0, e_r)
        used = e_c / bound if bound > 0 else (0.0 if e_c == 0 else float("inf"))
        r.tolerance_used = used if used != used else max(r.tolerance_used or 0.0, used)
        if not used <= 1.0:  # NaN fails too
            self.close = False


def wide_state(eng):
    """The reference's yardstick for tolerance mode: the engine's weights, tables and a cache
    of `exact_rows` slots in the wider dtype. Built for one check and dropped after it (about
    3.5x the weights' bytes for a bf16 model: a persistent engine does not hold it)."""
    from engine_server.state import State, new_cache
    st, dtype = eng.state, WIDER.get(eng.state.dtype, torch.float64)
    weights = {k: t.to(dtype) for k, t in st.weights.items()}
    rows = min(eng.config.exact_rows, eng.config.max_batch)
    k, v = new_cache(st.config, rows, st.max_seq, dtype, st.device)
    return State(st.config, weights, k, v, eng.family.tables(st.config, weights, st.max_seq, dtype, st.device),
                 st.layers)


def _wide_side(w, eng, noise, prompts, stream, layers=None, solo=None):
    """The wide reference `w` on the same prompts and, teacher-forced, the reference's tokens
    (`stream`: all rows' steps, then `solo`: the first row's steps alone)."""
    n = w.num_slots
    w.load_cache([t[:n].to(w.dtype) for t in noise[0]], [t[:n].to(w.dtype) for t in noise[1]])
    st = w.view(layers=w.layers if layers is None else layers)
    dev = eng.device
    fwd = eng.family.forward
    pre = [fwd(st, prefill_batch(torch.tensor([ids], device=dev), torch.tensor([slot], device=dev)))
           for slot, ids in enumerate(prompts)]
    if stream is None:
        return pre, []
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    slots = torch.arange(len(prompts), device=dev)
    steps = len(stream) - 1
    dec = [fwd(st, decode_batch(stream[s], lens + s, slots)) for s in range(steps)]
    if solo is not None:
        dec += [fwd(st, decode_batch(solo[s], lens[:1] + steps + s, slots[:1])) for s in range(len(solo) - 1)]
    return pre, dec


def _side(eng, cand, noise, prompts, steps):
    """Prefill each row alone, greedy-decode all rows together, then the first row alone;
    returns (prefill logits, decode logits per step (the rows' steps, then the solo ones),
    tokens per step of all rows, of the first row alone, cache after, violations)."""
    eng.state.load_cache(*noise)
    st = eng.candidate_state(cand)
    dev, viol = eng.device, []
    pre, toks, lens = [], [], []
    for slot, ids in enumerate(prompts):
        b = prefill_batch(torch.tensor([ids], device=dev), torch.tensor([slot], device=dev))
        out, v = run_step(eng, cand, st, b)
        viol += v
        pre.append(out)
        toks.append(argmax(out).view(-1))
        lens.append(len(ids))
    cur = torch.cat(toks)
    slots = torch.arange(len(prompts), device=dev)
    lens_t = torch.tensor(lens, device=dev)
    dec, stream = [], [cur]
    for s in range(steps):
        out, v = run_step(eng, cand, st, decode_batch(cur, lens_t + s, slots))
        viol += v
        dec.append(out)
        cur = argmax(out).view(-1)
        stream.append(cur)
    solo = [cur[:1]]
    for s in range(SOLO_STEPS):
        out, v = run_step(eng, cand, st, decode_batch(solo[-1], lens_t[:1] + steps + s, slots[:1]))
        viol += v
        dec.append(out)
        solo.append(argmax(out).view(-1))
    return pre, dec, torch.stack(stream), torch.stack(solo), eng.state.clone_cache(), viol


def check(eng, cand, mode: str = "bitwise", factor: float = 2.0, floor: float = 1e-3) -> ExactResult:
    if mode not in ("bitwise", "tolerance"):
        raise ValueError(f"mode must be 'bitwise' or 'tolerance', not {mode!r}")
    cfg = eng.config
    ref = eng.candidates["reference"]
    from engine_server.traffic import sample_lengths
    rows = min(cfg.exact_rows, cfg.max_batch)
    reqs = sample_lengths(eng.traffic.trace, rows, seed=2)
    limit = min(cfg.exact_max_prompt, eng.state.max_seq - cfg.exact_steps - SOLO_STEPS - 2)
    prompts = [eng.traffic.tokens(max(1, min(r.prompt_len, limit)), 100 + i) for i, r in enumerate(reqs)]
    res = ExactResult(candidate_id=cand.id, ok=True, mode=mode, steps=cfg.exact_steps, rows=len(prompts))
    diff = _Diff(res, mode, factor, floor)
    noise = _noise(eng, seed=1234)

    c_pre, c_dec, c_stream, c_solo, c_kv, c_viol = _side(eng, cand, noise, prompts, cfg.exact_steps)
    eng.sweep_guards()  # a setting or function the pass left changed must not reach the reference's side
    r_pre, r_dec, r_stream, r_solo, r_kv, _ = _side(eng, ref, noise, prompts, cfg.exact_steps)
    res.violations += c_viol
    w_pre, w_dec, wide = [None] * len(r_pre), [None] * len(r_dec), None
    if mode == "tolerance":
        wide = wide_state(eng)
        with torch.no_grad():
            w_pre, w_dec = _wide_side(wide, eng, noise, prompts, r_stream, solo=r_solo)
    for i, (r, c, w) in enumerate(zip(r_pre, c_pre, w_pre)):
        diff.logits("prefill", i, r, c, w)
    n = cfg.exact_steps
    for s, (r, c, w) in enumerate(zip(r_dec[:n], c_dec[:n], w_dec[:n])):
        diff.logits("decode", s, r, c, w)
    first, was_close = res.first_mismatch is None, diff.close
    for s, (r, c, w) in enumerate(zip(r_dec[n:], c_dec[n:], w_dec[n:]), start=n):
        diff.logits("decode B=1", s, r, c, w)
    # named when only the solo steps differ: a pass that special-cases batch 1
    if (first and res.first_mismatch is not None) if mode == "bitwise" else (was_close and not diff.close):
        res.violations.append("batch-1 decode differs from the reference's (its batched decode matches)")
    res.tokens_equal = torch.equal(r_stream, c_stream) and torch.equal(r_solo, c_solo)
    if not torch.equal(r_stream, c_stream):
        res.token_divergence = _divergence((r_pre, r_dec), (c_pre, c_dec), (w_pre, w_dec), r_stream, c_stream)
    res.kv_equal = all(torch.equal(a, b) for a, b in zip(r_kv[0] + r_kv[1], c_kv[0] + c_kv[1]))
    if not res.kv_equal:
        res.violations.append(_kv_report(eng, r_kv, c_kv, prompts, cfg.exact_steps))

    # probe 1: the fast tier's layer subsets (its layers, and none: it extrapolates from both)
    for layers in (eng.fast_layers, ()):
        sub = {}
        for name, c in (("cand", cand), ("ref", ref)):
            eng.state.load_cache(*noise)
            st = eng.candidate_state(c, layers)
            b = prefill_batch(torch.tensor([prompts[0]], device=eng.device), torch.tensor([0], device=eng.device))
            sub[name] = output(eng, call(lambda: c.forward(st, b)), b).detach().clone()
            if name == "cand":
                eng.sweep_guards()
        if not torch.equal(sub["ref"], sub["cand"]):
            # a violation when everything else matched, or (tolerance) when this is what is not close
            first, was_close = res.first_mismatch is None, diff.close
            w_sub = None
            if wide is not None:
                with torch.no_grad():
                    w_sub = _wide_side(wide, eng, noise, prompts[:1], None, layers)[0][0]
            diff.logits("layers-subset", 0, sub["ref"], sub["cand"], w_sub)
            if first or (was_close and not diff.close):
                res.violations.append(f"does not honour state.layers: on layers {list(layers)} "
                                      f"its logits differ from the reference's")

    # probe 2: the same step on a changed cache must change the output as the reference's does
    probe = {}
    last = decode_batch(r_stream[-2], torch.tensor([len(p) + cfg.exact_steps - 1 for p in prompts],
                                                   device=eng.device), torch.arange(len(prompts), device=eng.device))
    for name, c in (("cand", cand), ("ref", ref)):
        outs = []
        for seed in (1234, 99):
            eng.state.load_cache(*_noise(eng, seed))
            outs.append(run_step(eng, c, eng.candidate_state(c), last)[0])
        probe[name] = outs
    for k in range(2):
        if not torch.equal(probe["ref"][k], probe["cand"][k]):
            diff.logits("probe", k, probe["ref"][k], probe["cand"][k])
            if k == 1 and torch.equal(probe["cand"][0], probe["cand"][1]):
                res.violations.append("returned a result kept from an earlier call: the same step on a "
                                      "different cache gave the same logits")
    bitwise = res.first_mismatch is None and res.tokens_equal and res.kv_equal
    res.exact = bitwise and not res.violations
    if mode == "tolerance":
        own_cells = [v for v in res.violations if not v.startswith("K/V in its own cells differ")]
        res.close = diff.close and res.tokens_equal and not own_cells
        res.tolerance = {"factor": factor, "floor": floor, "wide_dtype": str(wide.dtype)}
    return res


def _divergence(ref, cand, wide, r_stream, c_stream) -> TokenDivergence | None:
    """The first (step, row) whose greedy token differs, with each side's logit gap there.
    ref / cand / wide: (prefill logits per row, decode logits per step); stream[0] holds each
    row's token from its prefill, stream[s + 1] the tokens of decode step s."""
    if r_stream.shape != c_stream.shape:
        return None
    where = (r_stream != c_stream).nonzero()
    if len(where) == 0:
        return None
    t, row = where[0].tolist()

    def logits(side):
        out = side[0][row] if t == 0 else side[1][t - 1]
        return None if out is None else out[0 if t == 0 else row].float()
    a, b = int(r_stream[t, row]), int(c_stream[t, row])
    r, c, w = logits(ref), logits(cand), logits(wide)
    gap = (r[a] - r[b]).item()
    return TokenDivergence(phase="prefill" if t == 0 else "decode", step=max(0, t - 1), row=row,
                           reference_token=a, candidate_token=b, reference_gap=gap, candidate_gap=(c[b] - c[a]).item(),
                           wide_gap=None if w is None else (w[a] - w[b]).item(),
                           near_tie=near_tie(r[None].topk(min(NEAR_TIE_K, r.numel()), -1), torch.tensor([b], device=r.device)))


def _kv_report(eng, r_kv, c_kv, prompts, steps) -> str:
    """Say whether the differing cells lie inside or outside the batch's own cells."""
    owned = set()
    for slot, p in enumerate(prompts):  # the first row also decoded SOLO_STEPS alone
        owned |= {(slot, pos) for pos in range(len(p) + steps + (SOLO_STEPS if slot == 0 else 0))}
    outside = inside = 0
    for a, b in zip(r_kv[0] + r_kv[1], c_kv[0] + c_kv[1]):
        ne = (a != b).any(dim=1).any(dim=-1).nonzero().tolist()  # [(slot, pos)]
        for slot, pos in ne:
            if (slot, pos) in owned:
                inside += 1
            else:
                outside += 1
    if outside:
        return f"wrote K/V outside its cache cells ({outside} cells outside the batch's slots/positions)"
    return f"K/V in its own cells differ from the reference's ({inside} cells)"
