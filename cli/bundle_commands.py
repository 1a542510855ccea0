"""``aotc export`` / ``aotc import``: one entry as one relocatable file (``aotc.fleet.bundle``)."""

from __future__ import annotations

from pathlib import Path

import click

from aotc.cache.humanize import format_size
from aotc.cli.common import AppContext, guard, pass_app, print_json
from aotc.cli.options import allow_unsigned_option, json_option, trust_option


@click.command("export")
@click.argument("target")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The bundle file to write (e.g. model.aotc).")
@json_option
@pass_app
@guard
def export_command(app: AppContext, target: str, output: str, as_json: bool) -> None:
    """Write one entry (TARGET: a manifest — its entry for this machine — or a stored key or
    unique prefix) to a relocatable bundle file."""
    from aotc.fleet.bundle import export_entry

    app.local_only("export")
    from aotc.lookup.explain import entry_key_for

    result = export_entry(app.store, entry_key_for(app.store, target), output)
    if as_json:
        print_json(result.to_json())
        return
    click.echo(f"exported {result.name} {result.key[:16]}… ({result.blobs} blobs, "
               f"{format_size(result.bytes)}) to {result.path}")


@click.command("import")
@click.argument("bundle", type=click.Path(dir_okay=False, exists=True))
@trust_option
@allow_unsigned_option
@json_option
@pass_app
@guard
def import_command(app: AppContext, bundle: str, trust: tuple[str, ...], allow_unsigned: bool,
                   as_json: bool) -> None:
    """Verify BUNDLE completely (every digest; a signature by a trusted key unless
    --allow-unsigned), then add its entry to the store. Importing an entry already there does
    nothing."""
    from aotc.fleet.bundle import import_bundle

    app.local_only("import")
    policy = app.policy(trust, allow_unsigned)
    result = import_bundle(app.writable_store, Path(bundle), trusted=policy)
    if as_json:
        print_json(result.to_json())
        return
    if result.imported:
        click.echo(f"imported {result.name} {result.key[:16]}… ({result.blobs} blobs, "
                   f"{format_size(result.bytes)}) into {app.store.root}")
    else:
        click.echo(f"{result.name} {result.key[:16]}… is already in {app.store.root}: nothing to do")
