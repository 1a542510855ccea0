"""``aotc push`` / ``aotc pull``: entries between the local store and a remote one (``aotc.fleet.sync``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from aotc.cache.humanize import format_size
from aotc.cli.common import AppContext, echo_err, guard, pass_app, print_json
from aotc.cli.options import allow_unsigned_option, json_option, quiet_option, trust_option


def _print(result: Any, as_json: bool, local: Path) -> None:
    if as_json:
        return
    if result.direction == "push":
        where = f"to {result.remote}"
    else:
        where = f"from {result.remote} into {local}"
    if result.moved:
        click.echo(f"{result.direction}ed {result.name} {result.key[:16]}… {where}: "
                   f"{result.blobs_moved} of {result.blobs} blobs, {format_size(result.bytes_moved)} moved"
                   + (f" ({result.note})" if result.note else ""))
    else:
        click.echo(f"{result.name} {result.key[:16]}… is already there ({where}): nothing moved"
                   + (f"; {result.note}" if result.note else ""))


@click.command("push")
@click.argument("target", required=False)
@click.option("--to", "url", default=None, metavar="s3://BUCKET/PREFIX|oci://HOST/REPO",
              help="The remote store (default: --store / --remote / $AOTC_REMOTE).")
@click.option("--force", is_flag=True,
              help="Upload every blob and replace the remote record (repairs a damaged remote entry).")
@quiet_option
@json_option
@pass_app
@guard
def push_command(app: AppContext, target: str | None, url: str | None, force: bool, quiet: bool,
                 as_json: bool) -> None:
    """Upload TARGET's entry (a manifest — its entry for this machine — or a stored key or
    unique prefix; default: every good entry) to the remote store. Blobs the remote has are
    not uploaded again; the entry's record is written last."""
    from aotc.cache import CacheMiss, CorruptedCacheError
    from aotc.fleet.sync import push_entry
    from aotc.fleet.trust import sign_with
    from aotc.lookup.explain import entry_key_for
    from aotc.progress import Progress

    remote = app.remote(url, required="push")
    store = app.store
    signer = app.context().signer  # AOTC_SIGNING_KEY: what is pushed arrives signed (read first)
    keys = [entry_key_for(store, target)] if target else [k for k in store.keys() if store.has(k)]
    results, failed = [], []
    for k in keys:
        try:
            sign_with(store, k, signer)
            results.append(push_entry(store, remote, k, force=force,
                                      progress=Progress(sys.stderr, quiet=quiet or as_json)))
        except (CacheMiss, CorruptedCacheError) as e:
            if target:  # the one entry asked for: its error is the answer
                raise
            failed.append({"key": k, "error": " ".join(str(e).split())})  # the others go on
    if as_json:
        print_json({"remote": remote.url, "store": str(store.root),
                    "entries": [r.to_json() for r in results], "failed": failed,
                    "bytes_moved": sum(r.bytes_moved for r in results)})
    else:
        for r in results:
            _print(r, as_json, store.root)
        for f in failed:
            echo_err(f"not pushed {f['key'][:16]}…: {f['error']}")
        if not keys:
            click.echo(f"store {store.root} is empty: nothing to push")
    if failed:
        sys.exit(1)


@click.command("pull")
@click.argument("target")
@click.option("--from", "url", default=None, metavar="s3://BUCKET/PREFIX|oci://HOST/REPO",
              help="The remote store (default: --store / --remote / $AOTC_REMOTE).")
@trust_option
@allow_unsigned_option
@quiet_option
@json_option
@pass_app
@guard
def pull_command(app: AppContext, target: str, url: str | None, trust: tuple[str, ...],
                 allow_unsigned: bool, quiet: bool, as_json: bool) -> None:
    """Download TARGET's entry (a manifest — the remote entry it compiles to on this machine —
    or a remote key or unique prefix) into the local store, every blob verified first."""
    from aotc.cache import CacheMiss
    from aotc.fleet.sync import pull_entry, remote_key_for
    from aotc.progress import Progress

    remote = app.remote(url, required="pull")
    store, trusted = app.writable_store, app.policy(trust, allow_unsigned)
    progress = Progress(sys.stderr, quiet=quiet or as_json)
    if Path(target).is_file():
        from aotc.fleet.tiered import pull_manifest
        from aotc.manifest import load_manifest
        from aotc.model.build import build_model

        m = load_manifest(target)
        result = pull_manifest(m, remote, store, trusted, progress, build=lambda: build_model(m))
        if result is None:
            raise CacheMiss("0" * 64, hint=f"{remote.url} has no entry of {m.name} for this machine "
                                           f"and these sources; `aotc compile {target}` and "
                                           "`aotc push` it from a build machine")
    else:
        result = pull_entry(remote, store, remote_key_for(remote, target), trusted, progress)
    if as_json:
        print_json({**result.to_json(), "store": str(store.root)})
        return
    _print(result, as_json, store.root)
