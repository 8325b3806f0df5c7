"""The `raylazy` command: `plan` prints (and saves) a checkpoint's per-rank plan, `load` runs a load on Ray, `hold`
keeps a checkpoint in a Ray cluster's object store (lists and releases holders)."""

from __future__ import annotations

import argparse
import sys
import tempfile

from .errors import ConfigurationError, RaylazyError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="raylazy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan which bytes each tensor-parallel rank reads (headers only)")
    p.add_argument("model_dir", help="model directory, or a model id (org/name[@revision]) in the local Hugging Face cache")
    _planning_args(p)
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON to PATH ('-' for stdout)")
    p.add_argument("--ranks-per-node", type=int, default=None, metavar="N",
                   help="schedule cooperative reads for N ranks per node (default: all ranks on one node)")
    p.add_argument("--stripe-bytes", type=int, default=None, help="largest stripe a node's reader reads at once")
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="spread the ranks evenly over N nodes (instead of --ranks-per-node)")
    p.add_argument("--replicas", type=int, default=1, help="copies of the rank grid, as `raylazy load` (default 1)")
    p.add_argument("--estimate", action="store_true", help="print the predicted load time on --hardware for "
                   "raylazy, a naive loader and vLLM's default loader (raylazy.estimate: model output)")
    p.add_argument("--hardware", default=None, metavar="FILE|PRESET", help="hardware description (JSON or YAML) or "
                   "a preset's name (docs/estimate.md lists them; a wrong name is told the names); the plan is made "
                   "for its storage")
    p.add_argument("--live-source", action="store_true",
                   help="with --estimate: every rank copies from a live replica instead of reading storage")

    p = sub.add_parser("load", help="load a checkpoint on Ray, one actor per rank, and print the summary")
    p.add_argument("model_dir", nargs="?", help="model directory (default: generate a small Llama-shaped one)")
    _planning_args(p)
    p.add_argument("--replicas", type=int, default=1,
                   help="copies of the rank grid: replica 0 reads from storage, the others copy from it (default 1)")
    p.add_argument("--backend", choices=["auto", "ranged", "cooperative", "exchange", "fastsafetensors"],
                   default="auto")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--queue-size", type=int, default=None)
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    p.add_argument("--no-progress", action="store_true")

    p.add_argument("--from-holder", action="store_true",
                   help="copy every rank's shards out of the holder of MODEL_DIR on its node (`raylazy hold`)")

    p = sub.add_parser("hold", help="keep a checkpoint in the Ray cluster's object store for loads and vLLM engines "
                       "(read from storage once), list the holders, or release them")
    p.add_argument("model_dir", nargs="?", help="model directory, URI, or model id in the local Hugging Face cache")
    p.add_argument("--nodes", type=int, default=None, metavar="N",
                   help="hold it on N nodes, this one first (default: every alive node)")
    p.add_argument("--budget-bytes", type=int, default=None,
                   help="most object-store bytes a node's holder may take (default: the node's object store)")
    p.add_argument("--idle-s", type=float, default=None, help="release a holder no load took from for this long")
    p.add_argument("--list", action="store_true", help="list the holders of this cluster")
    p.add_argument("--release", action="store_true", help="release the holders of MODEL_DIR (or of the holder named)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE", dest="storage_options",
                   help="object storage setting over the environment's; repeatable")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS)")

    args = parser.parse_args(argv)
    try:
        return _plan(args) if args.command == "plan" else _hold(args) if args.command == "hold" else _load(args)
    except RaylazyError as e:
        print(f"raylazy: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _planning_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel world size (default 1, as raylazy.plan/load)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1); ranks are stage-major")
    p.add_argument("--pp-layers", type=lambda v: [int(n) for n in v.split(",")], default=None, metavar="N,N,...",
                   help="layers per stage (default: vLLM's even split, the remainder to the stages before the last)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="routed MoE experts whole to the tp ranks of their stage instead of tp slices")
    p.add_argument("--keep-mtp", action="store_true", help="load the multi-token-prediction layers past the last "
                   "decoder layer (DeepSeek-V3's layer 61), which are skipped by default as vLLM's main model skips them")
    p.add_argument("--preset", default="auto", help="sharding preset (default: from config.json model_type)")
    p.add_argument("--uneven", choices=["error", "chunk", "pad"], default="error",
                   help="what to do with a dim tp does not divide")
    p.add_argument("--max-gap", type=int, default=None, help="read row gaps up to this many bytes as one request "
                   "(default: 0 for local files, 1 MiB for object storage)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE", dest="storage_options",
                   help="object storage setting over the environment's (endpoint=..., allow_http=true, region=...); "
                   "repeatable")
    p.add_argument("--rules", metavar="FILE", help='sharding rules (JSON list of {"pattern": ..., "placement": '
                   '{"type": ...}}), tried before the preset; see docs/rules.md')


def _mesh_args(args) -> dict:
    return {"pp": args.pp, "pp_layers": args.pp_layers, "expert_parallel": args.expert_parallel,
            "keep_mtp": args.keep_mtp}


def _storage_options(args) -> dict[str, str]:
    bad = [o for o in args.storage_options if "=" not in o]
    if bad:
        raise ConfigurationError(f"--storage-option {bad[0]!r}: give KEY=VALUE")
    return dict(o.split("=", 1) for o in args.storage_options)


def _rules(args):
    from .core.rules import read_rules

    return read_rules(args.rules) if args.rules else None


def _plan(args) -> int:
    from .core.planner import with_replicas
    from .core.schedule import with_node_schedules
    from .planning import make_plan

    hardware = _hardware(args) if args.estimate or args.hardware else None  # a bad file fails before planning
    plan = make_plan(args.model_dir, args.tp, rules=_rules(args), **_mesh_args(args), preset=args.preset,
                     uneven=args.uneven, max_gap=args.max_gap, storage_options=_storage_options(args),
                     cost_model=hardware.storage.cost_model() if hardware else None)
    if args.replicas != 1:
        plan = with_replicas(plan, args.replicas)
    per_node = _ranks_per_node(args, len(plan.ranks))
    plan = with_node_schedules(plan, [f"node{r // per_node}" for r in range(len(plan.ranks))], args.stripe_bytes)
    if args.json == "-":
        print(plan.to_json())
        return 0
    print(plan.summary())
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(plan.to_json())
        print(f"plan written to {args.json}")
    if args.estimate:
        _print_estimates(plan, hardware, per_node, args)
    return 0


def _ranks_per_node(args, ranks: int) -> int:
    if args.nodes is not None and args.ranks_per_node is not None:
        raise ConfigurationError("give --nodes or --ranks-per-node, not both")
    if args.nodes is not None:
        if args.nodes < 1 or ranks % args.nodes:
            raise ConfigurationError(f"--nodes {args.nodes} must be at least 1 and divide the {ranks} ranks evenly")
        return ranks // args.nodes
    per_node = args.ranks_per_node or ranks
    if per_node < 1:
        raise ConfigurationError(f"--ranks-per-node must be at least 1, got {per_node}")
    return per_node


def _hardware(args):
    import os

    from .core.hardware import parse_hardware, preset, presets

    if not args.hardware:
        raise ConfigurationError("--estimate needs --hardware FILE or a preset: " + ", ".join(presets()))
    if not os.path.exists(args.hardware):
        return preset(args.hardware)
    with open(args.hardware, encoding="utf-8") as fh:
        return parse_hardware(fh.read(), args.hardware)


def _print_estimates(plan, hardware, per_node: int, args) -> None:
    from .core.estimate import LOADERS, estimate

    for loader in LOADERS:
        est = estimate(plan, hardware, loader=loader, ranks_per_node=per_node, live_source=args.live_source)
        print()
        print(est.summary())
        if args.live_source:
            break  # a copy from a live replica is the same for every loader
    print()
    print("assumptions:")
    for line in est.assumptions:
        print(f"  - {line}")


def _load(args) -> int:
    import ray

    from .cluster.loader import load

    rules = _rules(args)  # a bad rules file fails before Ray starts
    with tempfile.TemporaryDirectory(prefix="raylazy-demo-") as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from .synthetic import write_llama_checkpoint

            model_dir = write_llama_checkpoint(tmp)
            print(f"no model given: generated a Llama-shaped checkpoint in {model_dir}")
        if args.address:
            ray.init(address=args.address)
        held = _found(model_dir) if args.from_holder else None
        loaded = load(model_dir, args.tp, source=held, **_mesh_args(args), replicas=args.replicas, rules=rules,
                      backend=args.backend, device=args.device,
                      queue_size=args.queue_size, preset=args.preset, uneven=args.uneven, max_gap=args.max_gap,
                      storage_options=_storage_options(args), progress=False if args.no_progress else None)
        try:
            print(f"{'rank':>4} {'replica':>7} {'stage':>5} {'tp rank':>7} {'node':>10} {'device':>7} {'tensors':>7} "
                  f"{'bytes':>12} {'from peers':>12} {'requests':>9} {'seconds':>8} {'rchar':>12}")
            for info, c, st, rp in zip(loaded.ranks, loaded.mesh, loaded.stats, loaded.plan.ranks):
                print(f"{info.rank:>4} {c.replica:>7} {c.stage:>5} {c.tp_rank:>7} {info.node_id[:10]:>10} "
                      f"{info.device:>7} {len(rp.tensors):>7} {st.bytes_needed:>12} {st.bytes_from_replica + st.bytes_from_holder:>12} "
                      f"{st.requests:>9} {st.seconds:>8.3f} {'-' if st.rchar is None else st.rchar:>12}")
            print(loaded.summary())
        finally:
            loaded.release()
    return 0


def _hold(args) -> int:
    """`raylazy hold`: in a running cluster (a holder lives on after this command: detached in it)."""
    import os

    import ray

    from .cluster.holder import hold, holders

    address = args.address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ConfigurationError("raylazy hold keeps a checkpoint in a running Ray cluster: give --address or "
                                 "RAY_ADDRESS (`ray start --head` starts one)")
    if args.list == bool(args.model_dir):
        raise ConfigurationError("give MODEL_DIR (to hold it, or --release it) or --list")
    ray.init(address=address, logging_level="WARNING")
    if args.list:
        print(f"{'node':>10} {'bytes':>14} {'from':>10} {'seconds':>8} {'idle s':>8}  checkpoint")
        for i in holders():
            print(f"{i.node_id[:10]:>10} {i.nbytes:>14} {i.filled_from[:10]:>10} {i.seconds:>8.2f} "
                  f"{i.idle_for_s:>8.0f}  {i.root}")
    elif args.release:
        _found(args.model_dir).release()
        print(f"released the holders of {args.model_dir}")
    else:
        print(hold(args.model_dir, nodes=args.nodes, budget_bytes=args.budget_bytes, idle_s=args.idle_s,
                   storage_options=_storage_options(args)).summary())
    return 0


def _found(model_dir: str):
    """The holders of `model_dir` (its root as planned, or a holder's name): HolderGoneError where none is."""
    from .cluster.bundles import ensure_ray
    from .cluster.holder import find
    from .errors import HolderGoneError
    from .storage import open_checkpoint

    ensure_ray()
    root = model_dir if model_dir.startswith("raylazy-holder:") else open_checkpoint(model_dir).root
    held = find(root)
    if held is None:
        raise HolderGoneError(f"{model_dir}: no holder of it in this Ray cluster (raylazy hold {model_dir})")
    return held


if __name__ == "__main__":
    sys.exit(main())
