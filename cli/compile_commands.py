"""``aotc compile`` and ``aotc explain``: commands that need torch (imported inside callbacks, so
the store commands stay torch-free)."""

from __future__ import annotations

import sys
from typing import Any

import click

from aotc.cache.humanize import format_size
from aotc.cli.common import AppContext, echo_err, guard, print_json
from aotc.cli.options import allow_unsigned_option, json_option, quiet_option, trust_option


def _store_for(ctx: click.Context, manifest: Any, create: bool = False) -> Any:
    """``--store`` / ``AOTC_STORE`` win; else the manifest's ``store:``; else the default.
    ``create``: make it when missing (only commands that write do)."""
    from aotc.lookup.stores import open_store

    app: AppContext = ctx.obj
    explicit = ctx.find_root().params.get("store_path") or app.settings.store
    if explicit or manifest.store is None:
        return app.writable_store if create else app.store
    return open_store(manifest.store, create=create, settings=app.settings)


@click.command("compile")
@click.argument("manifest", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Recompile even when the store has the entry.")
@json_option
@quiet_option
@click.option("-j", "--jobs", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Compile pieces in N processes (forked after the split).")
@click.pass_context
@guard
def compile_command(ctx: click.Context, manifest: str, force: bool, as_json: bool, quiet: bool,
                    jobs: int) -> None:
    """Trace MANIFEST's model once, split it at attention, compile each unique piece for every
    size with Inductor, check it against eager, and store the program."""
    from aotc.compile.pipeline import compile_manifest
    from aotc.manifest import load_manifest
    from aotc.progress import Progress
    from aotc.vllm.manifest import compile_vllm, is_vllm_manifest, load_vllm_manifest

    app: AppContext = ctx.obj
    if is_vllm_manifest(manifest):  # the engine runs once with the backend; it pushes to the remote
        vm = load_vllm_manifest(manifest)
        signer = app.context().signer  # a bad AOTC_SIGNING_KEY stops here, before the engine runs
        result = compile_vllm(vm, _store_for(ctx, vm, create=True), force=force, remote=app.remote(),
                              signer=signer)
        _print_result(result, None, as_json)
        return
    m = load_manifest(manifest)  # a bad manifest fails before the store is touched
    store = _store_for(ctx, m, create=True)
    # a miss is pulled from the remote, else compiled once across the fleet under its lease
    result = compile_manifest(m, force=force, progress=Progress(sys.stderr, quiet=quiet), jobs=jobs,
                              context=app.context(store=store, remote=app.remote()))
    remote = app.remote() if app.store_is_remote else None  # `--store s3://…`: publish there
    pushed = None
    if remote is not None:
        from aotc.fleet.sync import push_entry

        pushed = push_entry(store, remote, result.key, progress=Progress(sys.stderr, quiet=quiet or as_json))
    _print_result(result, pushed, as_json)


def _print_result(result: Any, pushed: Any, as_json: bool) -> None:
    if as_json:
        print_json({**result.to_json(), **({"push": pushed.to_json()} if pushed else {})})
        return
    if pushed is not None:
        click.echo(f"{result.name}: pushed to {pushed.remote}: {pushed.blobs_moved} of "
                   f"{pushed.blobs} blobs, {format_size(pushed.bytes_moved)}")
    if result.hit:
        how = (f"the engine found it in {result.seconds['engine']:.1f}s)" if "engine" in result.seconds
               else f"lookup {result.seconds.get('lookup', 0):.2f}s); --force recompiles")
        click.echo(f"{result.name}: up to date, key {result.key[:16]}… "
                   f"({result.pieces} pieces, {result.unique_pieces} unique; {how}")
        return
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items())
    click.echo(
        f"{result.name}: compiled {result.pieces} pieces ({result.unique_pieces} unique), "
        f"{result.compiles} Inductor compiles"
        + (f" ({result.shared} more taken from stored entries)" if getattr(result, "shared", 0) else "")
        + (f" ({result.resumed} more resumed from {result.resumed_from})" if result.resumed else "")
        + f", max abs err {result.max_abs_err:.3g}\n"
        f"  {phases}\n  stored {format_size(result.bytes_stored)} under key {result.key}\n"
        f"  store {result.store}"
    )
    for w in result.warnings:
        echo_err(f"warning: {w}")


@click.command("explain")
@click.argument("targets", nargs=-1, required=True, metavar="MANIFEST | KEY_A KEY_B")
@json_option
@click.pass_context
@guard
def explain_command(ctx: click.Context, targets: tuple[str, ...], as_json: bool) -> None:
    """Say whether MANIFEST has an entry for this machine and, if not, which key factors differ
    from the closest stored entry; with two stored keys (or unique prefixes), diff their factors."""
    from aotc.lookup.explain import explain_keys, explain_manifest
    from aotc.manifest import load_manifest

    ctx.obj.local_only("explain")
    if len(targets) == 2:
        report = explain_keys(ctx.obj.store, *targets)
    elif len(targets) == 1:
        m = load_manifest(targets[0])
        report = explain_manifest(m, store=_store_for(ctx, m))
    else:
        raise click.UsageError("give one MANIFEST, or two stored keys KEY_A KEY_B")
    if as_json:
        print_json(report)
        return
    click.echo(report["summary"])
    for line in report["differences"]:
        click.echo(f"  {line}")


def _parse_sizes(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        sizes = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated token counts, e.g. 1,7,16") from None
    if not sizes or any(n < 1 for n in sizes):
        raise click.BadParameter(f"{value!r}: token counts must be positive")
    return sizes


@click.command("run")
@click.argument("manifest", type=click.Path(dir_okay=False))
@click.option("--sizes", default="1,7,16,100", callback=_parse_sizes, show_default=True,
              help="Token counts to run.")
@click.option("--check-eager", is_flag=True, help="Compare with the eager model; exit 1 above tolerance.")
@trust_option
@allow_unsigned_option
@json_option
@click.pass_context
@guard
def run_command(ctx: click.Context, manifest: str, sizes: list[int], check_eager: bool,
                trust: tuple[str, ...], allow_unsigned: bool, as_json: bool) -> None:
    """Warm-start MANIFEST's compiled program in this process (no trace, no compile) and run it."""
    from aotc.manifest import load_manifest
    from aotc.runtime.report import check_report, run_manifest

    m = load_manifest(manifest)
    remote = ctx.obj.remote()
    store = _store_for(ctx, m, create=remote is not None)  # pull-through writes into it
    report = run_manifest(m, sizes, store=store, check_eager=check_eager,
                          trust=ctx.obj.policy(trust, allow_unsigned), remote=remote)
    if as_json:
        print_json(report)
    else:
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in report["phases"].items())
        click.echo(f"{report['name']}: warm start in {report['load_seconds']:.2f}s ({phases}); "
                   f"traces {report['traces']}, compiles {report['compiles']}"
                   + (f"; pulled {format_size(report['pulled_bytes'])}" if report["pulled_bytes"] else ""))
        g = report.get("cudagraphs")
        if g:
            click.echo(f"  CUDA graphs ({g['mode']}): {g['graphs']} captured for sizes "
                       f"{g['sizes']} in {g['seconds']:.2f}s, pool {format_size(g['pool_bytes'])}")
        first = report.get("first_call")
        if first:
            click.echo(f"  first call ({first['tokens']} tokens): {first['seconds']:.2f}s, one-time "
                       "costs included (Runner.warmup() pays them before serving)")
        for i, (n, e) in enumerate(report["sizes"].items()):
            err = f", max abs err vs eager {e['max_abs_err']:.3g}" if "max_abs_err" in e else ""
            via = f" (graphs at {e['graph_size']})" if e.get("graph_size") else ""
            first_mark = " (first call)" if i == 0 else ""
            click.echo(f"  {n:>5} tokens: {e['seconds'] * 1000:.1f} ms{first_mark} -> "
                       f"{e['shape']}{err}{via}")
    check_report(report)


def register(group: click.Group) -> None:
    """Add the torch-backed commands to the CLI group."""
    group.add_command(compile_command)
    group.add_command(explain_command)
    group.add_command(run_command)
    group.add_command(precompile_command)


@click.command("precompile")
@click.argument("manifest", type=click.Path(dir_okay=False))
@click.option("--size", "sizes", type=click.IntRange(1, None), multiple=True, metavar="N",
              help="Trace at N tokens (repeatable; default: the manifest's compile_sizes).")
@json_option
@click.pass_context
@guard
def precompile_command(ctx: click.Context, manifest: str, sizes: tuple[int, ...], as_json: bool) -> None:
    """Trace MANIFEST's model with Dynamo once per size, aotc as the backend, and store Dynamo's
    output so a server starts without tracing (the load call it prints: ``aotc.precompiled(model,
    name=NAME, <the manifest's options>)``)."""
    from aotc.dynamo_artifacts.manifest import precompile_file

    app: AppContext = ctx.obj
    result = precompile_file(manifest, sizes, store=lambda m: _store_for(ctx, m, create=True), remote=app.remote())
    if as_json:
        print_json(result.to_json())
        return
    click.echo(f"{result.name}: precompiled {result.target} at {', '.join(map(str, result.sizes))} "
               f"tokens in {result.seconds:.1f}s, key {result.key[:16]}…\n"
               f"  calls {len(result.graphs)} graph entr{'y' if len(result.graphs) == 1 else 'ies'}; "
               f"load it with {result.load}\n  store {result.store}")
