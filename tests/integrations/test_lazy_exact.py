"""Lazy weights against eager torch, differentially: random but ordinary weight-loader programs (chains of narrow,
select, indexing, chunk, split, unbind, view/reshape, view(dtype), transpose/t/T/permute, to(dtype), contiguous,
clone; copies into parameters, fused and stacked parameters, scales stored by index, in-place ops after a copy,
cat/stack) over a checkpoint of mixed dtypes (float32, bfloat16, float16, int8, float8) and odd sizes, filled
with random bits (NaN payloads, -0, infinities and subnormals included). Each program runs through every path the
vLLM format takes (`PATHS`) and every parameter, untouched parts included, must equal byte for byte what the same
program leaves in eager torch over safetensors' full tensors (`safe_open(...).get_tensor`), or the path must
raise raylazy's `LazyWeightError` where eager torch's views would show an in-place change; and a program whose every
op is one lazy weights follow (`NOT_FOLLOWED` finds none of the others) must read nothing at once.

A failing program is shrunk and printed as the code it runs. `RAYLAZY_EXACT_PROGRAMS` sets how many programs
hypothesis draws (`PROGRAMS`: 200 by default; the nightly size: docs/testing.md); with
`--hypothesis-show-statistics`, the share of programs in which some weight was read at once ("read at once")
instead of followed, and of those run again instead of replayed ("run again")."""

from __future__ import annotations

import json
import os
import re
import threading

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from raylazy.core.options import serving_options
from raylazy.errors import LazyWeightError
from raylazy.integrations.lazy import lazy_weights
from raylazy.integrations.reload import _Run
from raylazy.integrations.runs import at_once, recorded
from raylazy.io.regions import RegionReader
from raylazy.io.serving import Serving
from raylazy.storage import open_checkpoint
from tests.support.nodes import ThreadNode

#: Programs a test run draws by default; RAYLAZY_EXACT_PROGRAMS sets another number (the nightly size: 5000).
PROGRAMS = int(os.environ.get("RAYLAZY_EXACT_PROGRAMS", 200))
F8 = torch.float8_e4m3fn
#: The checkpoint: name -> (shape, dtype), in two files.
TENSORS = {
    "a": ((70, 13), torch.float32), "b": ((5, 30, 7), torch.bfloat16), "c": ((11,), torch.float16),
    "d": ((60, 101), torch.int8), "e": ((4, 1, 5), F8), "f": ((), torch.float32), "g": ((90, 41), torch.bfloat16),
    "h": ((1, 9), torch.float16), "i": ((3, 5, 2, 4), torch.float32), "j": ((8,), F8), "k": ((2, 6), torch.int8),
}
#: Dtypes of the same size a view(dtype) reinterprets as.
SAME_SIZE = {1: [torch.int8, torch.uint8, F8], 2: [torch.int16, torch.float16, torch.bfloat16],
             4: [torch.int32, torch.float32]}
FLOATS = [torch.float32, torch.bfloat16, torch.float16, torch.float64, F8]


def random_bits(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> str:
    """The checkpoint, in two files with an index (odd tensors in the second)."""
    out = tmp_path_factory.mktemp("exact")
    files = {"model-00001-of-00002.safetensors": {}, "model-00002-of-00002.safetensors": {}}
    for n, (name, (shape, dtype)) in enumerate(TENSORS.items()):
        list(files.values())[n % 2][name] = random_bits(shape, dtype, n)
    for fname, tensors in files.items():
        save_file(tensors, str(out / fname))
    index = {name: fname for fname, tensors in files.items() for name in tensors}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(out)


# ---- programs: drawn op by op, each tried on zeroed stand-ins (a program eager torch refuses is never drawn)


def _meta(params: dict) -> dict:
    """A namespace of zeroed stand-ins, the checkpoint's tensors (W) and the parameters (P), to try code on (not
    meta tensors: some ops eager torch refuses only on the CPU, float8 arithmetic among them)."""
    return {"torch": torch, "W": {n: torch.zeros(s, dtype=d) for n, (s, d) in TENSORS.items()},
            "P": {k: torch.zeros(s, dtype=d) for k, (s, d) in params.items()}}


def _value(expr: str, params: dict):
    """The stand-in tensor `expr` gives, or None where eager torch refuses it (then it is never drawn)."""
    try:
        return eval(expr, _meta(params))
    except Exception:  # noqa: BLE001
        return None


def _valid(code: str, params: dict) -> bool:
    """Whether eager torch runs the statements `code` (on stand-ins)."""
    try:
        exec(code, _meta(params))
        return True
    except Exception:  # noqa: BLE001
        return False


@st.composite
def _view(draw, e: str, m: torch.Tensor) -> str:
    """One op on expression `e` (its stand-in `m`): followed (a view or a conversion) or not (reads at once)."""
    n, shape = m.ndim, tuple(m.shape)
    d = draw(st.integers(0, n - 1)) if n else 0
    size = shape[d] if n else 0
    start = draw(st.integers(0, size)) if n else 0
    length = draw(st.integers(0, size - start)) if n else 0
    floating = m.dtype.is_floating_point and m.dtype != F8
    kinds = ["to", "to", "contiguous", "clone", "detach", "unsqueeze", "reshape1"] + (
        ["narrow", "torch.narrow", "select", "slice", "index", "chunk", "split", "unbind", "transpose", "permute",
         "squeeze", "flatten", "dtype_view", "cat", "stack"] if n else [])
    kinds += ["t"] * (n <= 2) + ["T"] * (n == 2) + ["arith"] * floating + ["view_kw"] * bool(n)
    kind = draw(st.sampled_from(kinds))
    neg = draw(st.booleans())
    from_end = start - size if start < size and draw(st.booleans()) else start  # a start counted from the end
    fixed = {"narrow": f"{e}.narrow({d - n if neg else d}, {from_end}, {length})",
             "torch.narrow": f"torch.narrow({e}, {d}, {from_end}, {length})", "slice": f"{e}[{':, ' * d}{start}:{start + length}]",
             "t": f"{e}.t()", "T": f"{e}.T", "squeeze": f"{e}.squeeze({d})" if neg else f"{e}.squeeze()",
             "flatten": f"{e}.reshape(-1)",  # dims merged: read at once
             "cat": f"torch.cat([{e}, {e}], {d})", "stack": f"torch.stack([{e}, {e}])"}
    if kind in fixed:
        return fixed[kind]
    if kind == "select":
        return f"{e}.select({d}, {draw(st.integers(-size, size - 1)) if size else 0})"
    if kind == "index":
        return f"{e}[{draw(st.sampled_from(['None', '...', '0', '-1']))}]"
    if kind in ("chunk", "split"):
        k = draw(st.integers(1, max(size, 1)))  # a piece past the last is never drawn: eager torch refuses it
        return f"{e}.{kind}({k}, {d})[{draw(st.integers(0, max((size + k - 1) // k - 1, 0)))}]"
    if kind == "unbind":
        return f"{e}.unbind({d})[{draw(st.integers(0, max(size - 1, 0)))}]"
    if kind == "transpose":
        return f"{e}.transpose({d}, {draw(st.integers(-n, n - 1))})"
    if kind == "permute":  # a list, or the dims one by one
        order = draw(st.permutations(range(n)))
        return f"{e}.permute({order if neg else ', '.join(map(str, order))})"
    if kind == "unsqueeze":
        return f"{e}.unsqueeze({draw(st.integers(-n - 1, n))})"
    if kind == "reshape1":  # a dim of size 1 added, with view or reshape (followed)
        at = draw(st.integers(0, n))
        new = list(shape[:at]) + [1] + list(shape[at:])
        return f"{e}.{draw(st.sampled_from(['view', 'reshape']))}({tuple(new)})"
    if kind in ("dtype_view", "view_kw"):
        to = draw(st.sampled_from(SAME_SIZE.get(m.dtype.itemsize, [m.dtype])))
        return f"{e}.view({'dtype=' if kind == 'view_kw' else ''}torch.{str(to).split('.')[1]})"
    if kind == "to":
        to = draw(st.sampled_from(FLOATS if m.dtype.is_floating_point else FLOATS + [torch.int8]))
        how = draw(st.sampled_from(["to", "method"]))
        method = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat16", torch.float64: "double"}
        if how == "method" and to in method:
            return f"{e}.{method[to]}()"
        return f"{e}.to(torch.{str(to).split('.')[1]})"
    if kind == "arith":
        return f"({e} {draw(st.sampled_from(['* 1', '+ 0', '* 2', '- 1']))})"
    return f"{e}.{kind}()"


@st.composite
def _statement(draw, params: dict) -> str | None:
    """One load: a checkpoint tensor through a few ops, into a parameter (a new one of a shape that takes it)."""
    e = f"W[{draw(st.sampled_from(sorted(TENSORS)))!r}]"
    m, prelude = _value(e, params), ""
    for _ in range(draw(st.integers(0, 4))):
        nxt = draw(_view(e, m))
        got = _value(nxt, params)
        if isinstance(got, torch.Tensor):
            e, m = nxt, got
    if draw(st.integers(0, 4)) == 0:  # the loader changes the weight (a view of it, or a clone) before it copies it
        var = f"x{len(params)}"
        change = f"{var} = {e}{draw(st.sampled_from(['', '.clone()']))}\n{var}." + \
            draw(st.sampled_from(["mul_(2)", "add_(1)", "neg_()", "zero_()"]))
        if _valid(change, params):
            prelude, e = change + "\n", var
    shape, dtype = tuple(m.shape), m.dtype
    fits = [k for k, (s, _) in params.items() if shape and s and s[1:] == shape[1:] and s[0] >= shape[0]]
    how = draw(st.sampled_from(["whole", "fused", "stacked", "setitem", "scale", "broadcast"] + ["into"] * bool(fits)))
    if how == "into":  # another part of a parameter an earlier load wrote (q/k/v into one; overlapping too)
        k = draw(st.sampled_from(fits))
        dst = f"P[{k!r}].narrow(0, {draw(st.integers(0, params[k][0][0] - shape[0]))}, {shape[0]})"
        line = f"{dst}.copy_({e})"
        if not _valid(prelude + line, params):
            return None
    else:  # a new parameter, most often of the checkpoint's dtype
        k = f"p{len(params)}"
        floats = FLOATS if dtype.is_floating_point else FLOATS + [torch.int8, torch.int32]
        into = draw(st.one_of(st.just(dtype), st.sampled_from(floats)))
        pshape, dst = shape, f"P[{k!r}]"
        if how == "fused" and shape:  # a slice of a fused parameter (q/k/v, gate/up)
            extra = draw(st.integers(0, 3))
            pshape, dst = (shape[0] + extra,) + shape[1:], f"P[{k!r}].narrow(0, {draw(st.integers(0, extra))}, {shape[0]})"
        elif how == "stacked":  # an expert of a stacked parameter
            n = draw(st.integers(1, 3))
            pshape, dst = (n,) + shape, f"P[{k!r}][{draw(st.integers(0, n - 1))}]"
        elif how == "broadcast" and shape and shape[0] == 1:
            pshape = (draw(st.integers(2, 3)),) + shape[1:]
        elif how == "scale" and m.numel() == 1:  # a per-tensor scale stored by index
            n = draw(st.integers(1, 4))
            i = draw(st.integers(0, n - 1))
            pshape, dst = (n,), draw(st.sampled_from([f"P[{k!r}][{i}:{i + 1}]", f"P[{k!r}][{i}]"]))
        elif how == "setitem" and shape:
            dst = f"P[{k!r}][0:{shape[0]}]"
        params[k] = (pshape, into)
        indexed = dst != f"P[{k!r}]"  # `P[k] = e` would only rebind the name
        line = f"{dst} = {e}" if indexed and how in ("setitem", "scale") and draw(st.booleans()) else f"{dst}.copy_({e})"
        if not _valid(prelude + line, params):
            del params[k]
            return None
    after = draw(st.sampled_from(["", "", "add_", "iadd", "mul_", "again"]))
    more = {"add_": f"{dst}.add_({e})", "iadd": f"{dst} += {e}", "mul_": f"{dst}.mul_(2)",
            "again": f"{dst}.copy_({e})"}.get(after)
    if more and _valid(f"{prelude}{line}\n{more}", params):
        line += "\n" + more
    return prelude + line


@st.composite
def programs(draw) -> tuple[str, dict]:
    """(code, params: name -> (shape, dtype)): a few loads."""
    params: dict = {}
    lines = [line for line in (draw(_statement(params)) for _ in range(draw(st.integers(1, 4)))) if line]
    return "\n".join(lines), params


# ---- running a program: eagerly, and through each path


def _params(params: dict) -> dict[str, torch.Tensor]:
    """Each parameter's starting bytes (random: a part no copy writes must keep them)."""
    return {k: random_bits(s, d, 1000 + i) for i, (k, (s, d)) in enumerate(params.items())}


def _consumer(code: str, params: dict[str, torch.Tensor]):
    def consume(weights):
        exec(code, {"torch": torch, "W": dict(weights), "P": params})

    return consume


def eager(ckpt_dir: str, code: str, params: dict) -> dict[str, torch.Tensor]:
    weights = {}
    for f in sorted(os.listdir(ckpt_dir)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(ckpt_dir, f), "pt") as st_file:
                weights.update({n: st_file.get_tensor(n) for n in st_file.keys()})
    out = _params(params)
    _consumer(code, out)(weights.items())
    return out


def _recorded(ckpt_dir, code, params, options, group=None):
    """A load as the vLLM worker records it (`raylazy.integrations.runs.recorded`)."""
    ckpt = open_checkpoint(ckpt_dir)
    out = _params(params)
    with RegionReader(ckpt, options) as reads:
        run = recorded(_consumer(code, out), out.values, reads, options, torch.device("cpu"), group)
    return out, run.mode, reads.stats, run.takes


def _at_once(ckpt_dir, code, params, options):
    ckpt = open_checkpoint(ckpt_dir)
    out = _params(params)
    with RegionReader(ckpt, options) as reads:
        at_once(_consumer(code, out), reads, None)
    return out, "at-once", reads.stats, None


def _reload(ckpt_dir, code, params, options):
    """A load, then a reload over what it kept (its regions' takes), as `raylazy.integrations.reload` serves one:
    every copy made as it is asked, out of a Serving of the kept regions."""
    _, _, _, takes = _recorded(ckpt_dir, code, params, options)
    ckpt = open_checkpoint(ckpt_dir)
    out = _params(params)
    with RegionReader(ckpt, options) as reads, Serving(reads, takes, {}, None, "cpu") as serving:
        run = _Run(serving, _raise)
        _consumer(code, out)(lazy_weights(ckpt, run))
        run.drain()
    return out, "reload", reads.stats, None


def _raise(e: BaseException):
    raise e


def _node(ckpt_dir, code, params, options):
    """Two processes of a node (threads here) loading together, each with parameters of its own."""
    group, got, errors = ThreadNode(2), {}, []

    def worker(rank: int) -> None:
        try:
            got[rank] = _recorded(ckpt_dir, code, params, options, group.member(rank))
        except BaseException as e:  # noqa: BLE001  (raised below)
            errors.append(e)
            group.abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    assert got[0][0].keys() == got[1][0].keys()
    for k in got[0][0]:
        assert torch.equal(_bits(got[0][0][k]), _bits(got[1][0][k])), k
    return got[0]


#: Every path the vLLM format takes: (run, options).
PATHS = {
    "replay": (_recorded, {}),
    "ranged-small-batches": (_recorded, dict(backend="ranged", batch_bytes=4096, batches_ahead=0, threads=1)),
    "fastsafetensors": (_recorded, dict(backend="fastsafetensors")),
    "cooperative": (_recorded, dict(backend="cooperative")),
    "second-run": (_recorded, dict(replay=False)),
    "second-run-ranged": (_recorded, dict(replay=False, backend="ranged", batch_bytes=4096, batches_ahead=0)),
    "at-once": (_at_once, {}),
    "reload": (_reload, {}),
    "node": (_node, {}),
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Each element's bits, as an integer of its size."""
    return t.contiguous().reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


#: Ops that compute new values. Torch's own kernels give a NaN other bits in one memory layout than in another
#: (bfloat16 `x * 1` keeps a payload contiguous, makes it 0x7fc0 strided; a float32 NaN converted to bfloat16 keeps
#: its payload in a vectorized loop, becomes 0x7fc0 in a scalar one): where a program computes, or changes a weight
#: in place (the weight is then read at once, laid out as its region where eager torch's is a view of the whole
#: tensor, and a conversion after takes the other loop), a NaN must be a NaN, its payload aside; everywhere else
#: every bit counts.
ARITHMETIC = re.compile(r" [-+*] |add_|mul_|\+=")


#: A weight changed in place before it is copied (`x.mul_(2)`).
CHANGED = re.compile(r"\bx\d+\.\w+_\(")
#: Ops lazy weights do not follow (they read the weight at once): computing, changing in place, merging dims,
#: reinterpreting bits, joining tensors.
NOT_FOLLOWED = re.compile(ARITHMETIC.pattern + "|" + CHANGED.pattern +
                          r"|reshape\(-1\)|view\((dtype=)?torch\.|torch\.(cat|stack)")


def same(got: torch.Tensor, want: torch.Tensor, computed: bool) -> bool:
    """Whether `got` holds `want`'s bits (its NaNs' payloads aside where the program `computed`)."""
    if not (computed and want.is_floating_point()):
        return torch.equal(_bits(got), _bits(want))
    nan = want.reshape(-1).double().isnan()
    return torch.equal(got.reshape(-1).double().isnan(), nan) and torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def check(ckpt_dir: str, code: str, params: dict, paths=tuple(PATHS)) -> set[str]:
    """Every path leaves every parameter as eager torch does, byte for byte, or raises LazyWeightError, and the
    replay reads nothing at once where every op is one lazy weights follow; returns
    what the replay path did beside following (`events`)."""
    want, events = eager(ckpt_dir, code, params), set()
    for name in paths:
        run, options = PATHS[name]
        try:
            got, mode, stats, _ = run(ckpt_dir, code, params, serving_options(options))
        except LazyWeightError:  # only where the program changed a weight in place
            assert CHANGED.search(code), f"{name}: refused\n{code}"
            events.add("refused: a view used after an in-place change")
            continue
        for k, t in want.items():
            assert (got[k].dtype, got[k].shape) == (t.dtype, t.shape), f"{name}: {k} in\n{code}"
            computed = bool(ARITHMETIC.search(code) or CHANGED.search(code))
            assert same(got[k], t, computed), f"{name}: {k} differs from eager torch's in\n{code}"
        if name == "replay":
            assert not stats.opaque_regions or NOT_FOLLOWED.search(code), \
                f"read at once, though lazy weights follow every op of\n{code}"
            events |= {"read at once"} if stats.opaque_regions else set()
            events |= {"run again"} if mode == "rerun" else set()
    return events


#: The kinds of program found not exact, as seeds (each a kind of the issue that found them).
SEEDS = {
    "conversion-chain": ("P['p0'].copy_(W['a'].to(torch.bfloat16))", {"p0": ((70, 13), torch.float16)}),
    "half-float": ("P['p0'].copy_(W['a'].half().float())", {"p0": ((70, 13), torch.float32)}),
    "one-to-then-copy": ("P['p0'].copy_(W['c'].float())", {"p0": ((11,), torch.bfloat16)}),
    "in-place-after-copy": ("P['p0'].copy_(W['g'])\nP['p0'].add_(W['g'].narrow(1, 0, 1))",
                            {"p0": ((90, 41), torch.float32)}),
    "iadd-after-copy": ("P['p0'].copy_(W['a'])\nP['p0'] += W['a']", {"p0": ((70, 13), torch.float32)}),
    "scale-by-index": ("P['p0'][1:2].copy_(W['c'].select(0, 3))", {"p0": ((3,), torch.float16)}),
    "scale-setitem": ("P['p0'][2] = W['f']", {"p0": ((4,), torch.float32)}),
    "view-dtype-keyword": ("P['p0'].copy_(W['c'].view(dtype=torch.int16))", {"p0": ((11,), torch.int16)}),
    "overlap-beyond-neighbours": ("P['p0'].copy_(W['c'])\nP['p0'][1:3] = W['c'][0:2]\nP['p0'][5:7] = W['c'][4:6]",
                                  {"p0": ((11,), torch.float16)}),
    "fastsafetensors-regions-of-one-tensor": ("x1 = W['c'].clone()\nx1.mul_(2)\nP['p1'].copy_(x1)\n"
                                              "P['p2'].copy_(W['c'].narrow(0, 0, 1))\nP['p2'].add_(W['c'][0:1])",
                                              {"p1": ((11,), torch.float16), "p2": ((1,), torch.float16)}),
    "setitem-leading-ones": ("P['p0'][0] = W['f'].unsqueeze(0)", {"p0": ((1,), torch.float32)}),
    "empty-narrow-of-an-added-dim": ("P['p0'].copy_(W['a'].unsqueeze(0).narrow(0, 0, 0))",
                                     {"p0": ((0, 70, 13), torch.float32)}),
    "conversion-then-transpose": ("P['p0'].copy_(W['a'].to(torch.bfloat16).t())", {"p0": ((13, 70), torch.bfloat16)}),
    "changed-then-converted": ("x0 = W['g'].narrow(1, 0, 4)\nx0.neg_()\nP['p0'].copy_(x0)",
                               {"p0": ((90, 4), torch.bfloat16)}),
    "narrow-from-the-end": ("P['p0'].copy_(W['a'].narrow(0, -5, 3))", {"p0": ((3, 13), torch.float32)}),
    "take-written-into": ("x = W['a'].clone()\nz = W['a'].clone()\nx.mul_(0)\nP['p0'].copy_(z * 1)",
                          {"p0": ((70, 13), torch.float32)}),
}


@pytest.mark.parametrize("seed", SEEDS)
def test_seed_programs_are_exact_on_every_path(ckpt_dir, seed):
    code, params = SEEDS[seed]
    check(ckpt_dir, code, params)


@pytest.mark.timeout(max(600, PROGRAMS))  # a program takes 0.2 s or less: the nightly size too stays under it
@settings(max_examples=PROGRAMS, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                 HealthCheck.function_scoped_fixture])
@given(program=programs())
@example(program=SEEDS["conversion-chain"])
def test_random_programs_are_exact_on_every_path(ckpt_dir, program):
    code, params = program
    note(f"program:\n{code}")
    for what in check(ckpt_dir, code, params):
        event(what)

