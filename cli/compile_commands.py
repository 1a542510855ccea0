"""``aotc compile`` and ``aotc explain``: commands that need torch (imported inside callbacks, so
the store commands stay torch-free)."""

from __future__ import annotations

import click

from aotc.cache.humanize import format_size
from aotc.cli.common import AppContext, echo_err, guard, pass_app, print_json


@click.command("compile")
@click.argument("manifest", type=click.Path(dir_okay=False))
@click.option("--force", is_flag=True, help="Recompile even when the store has the entry.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option("-q", "--quiet", is_flag=True, help="No progress on stderr.")
@click.pass_context
@guard
def compile_command(ctx: click.Context, manifest: str, force: bool, as_json: bool, quiet: bool) -> None:
    """Trace MANIFEST's model once, split it at attention, compile each unique piece for every
    size with Inductor, check it against eager, and store the program."""
    from aotc.compiler import compile_manifest
    from aotc.manifest import load_manifest
    from aotc.progress import Progress

    app: AppContext = ctx.obj
    m = load_manifest(manifest)  # a bad manifest fails before the store is touched
    store = app.store if ctx.find_root().params.get("store_path") or m.store is None else m.store
    result = compile_manifest(m, store=store, force=force, progress=Progress(quiet=quiet))
    if as_json:
        print_json(result.to_json())
        return
    if result.hit:
        click.echo(f"{result.name}: up to date, key {result.key[:16]}… "
                   f"({result.pieces} pieces, {result.unique_pieces} unique; "
                   f"lookup {result.seconds.get('lookup', 0):.2f}s); --force recompiles")
        return
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in result.seconds.items())
    click.echo(
        f"{result.name}: compiled {result.pieces} pieces ({result.unique_pieces} unique), "
        f"{result.compiles} Inductor compiles, max abs err {result.max_abs_err:.3g}\n"
        f"  {phases}\n  stored {format_size(result.bytes_stored)} under key {result.key}\n"
        f"  store {result.store}"
    )
    for w in result.warnings:
        echo_err(f"warning: {w}")


@click.command("explain")
@click.argument("manifest", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@pass_app
@guard
def explain_command(app: AppContext, manifest: str, as_json: bool) -> None:
    """Say whether MANIFEST has an entry for this machine and, if not, which key factors differ
    from the closest stored entry."""
    from aotc.explain import explain_manifest

    report = explain_manifest(manifest, store=app.store)
    if as_json:
        print_json(report)
        return
    click.echo(report["summary"])
    for line in report["differences"]:
        click.echo(f"  {line}")


def register(group: click.Group) -> None:
    """Add the torch-backed commands to the CLI group."""
    group.add_command(compile_command)
    group.add_command(explain_command)
