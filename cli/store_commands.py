"""``aotc inspect cache``, ``aotc verify``, ``aotc gc``: the store made visible. No torch here."""

from __future__ import annotations

import sys
from typing import Any

import click

from aotc.cache import maintenance
from aotc.cache.humanize import format_age, format_size
from aotc.cli.common import AppContext, echo_err, guard, pass_app, print_json
from aotc.cli.options import json_option, trust_option

_COLUMNS = ("NAME", "KEY", "BLOBS", "PIECES", "SIZE", "ON DISK", "CREATED", "LAST USED", "HITS",
            "SHARED")


def _entry_table(entries: Any, verbose: bool, remote: bool = False) -> str:
    """The entries of a local or a remote scan (the same ``EntryInfo`` rows) as one table; a
    remote store keeps no last use or hits."""
    columns = (*_COLUMNS[:5], "ON REMOTE", "PUSHED") if remote else _COLUMNS
    rows: list[tuple[str, ...]] = [columns]
    for e in entries:
        row = (e.name + (" [BAD]" if e.bad else ""), e.key if verbose else e.key_short,
               str(e.blob_count), "-" if e.pieces is None else str(e.pieces), e.size_str,
               e.stored_size_str, e.created_str)
        shared = f"{e.shared_blobs} ({format_size(e.shared_stored_size)})" if e.shared_blobs else "-"
        rows.append(row if remote else (*row, e.last_used_str, str(e.hits), shared))
        if verbose and e.shapes:
            rows.append(("", "  shapes: " + ", ".join(e.shapes), *[""] * (len(columns) - 2)))
    return _table(rows)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


@click.group("inspect")
def inspect_group() -> None:
    """Look inside things aotc keeps."""


@inspect_group.command("cache")
@json_option
@click.option("-v", "--verbose", is_flag=True, help="Show full keys and the shapes of each entry.")
@pass_app
@guard
def inspect_cache(app: AppContext, as_json: bool, verbose: bool) -> None:
    """List the store's entries (a table like `hf cache scan`) and a summary line."""
    if app.store_is_remote:
        return _inspect_remote(app, as_json, verbose)
    s = maintenance.scan(app.store)
    limit = app.settings.max_size
    if as_json:
        print_json({**s.to_json(), "max_size": limit, "max_size_source": app.max_size_source,
                    "size_used": s.size_on_disk})
        return
    click.echo(_entry_table(s.entries, verbose) if s.entries else f"store {s.root} is empty")
    if s.failures:
        click.echo(f"\ngiven up on ({len(s.failures)}; a new process falls back until the next retry — "
                   "never for a failure known to repeat, until aotc or its toolchain changes; "
                   "`aotc gc` forgets them):")
        click.echo(_table([("NAME", "KEY", "CLASS", "ATTEMPTS", "NEXT RETRY", "WHEN", "REASON")] + [
            (f.name, f.key if verbose else f.key[:16], f.reason_class, str(f.attempts),
             f.next_retry_str(), format_age(f.time), f.reason if verbose else f.reason[:100])
            for f in s.failures]))
    click.echo(
        f"\n{len(s.entries)} entries, {s.size_on_disk_str} on disk, {len(s.orphan_blobs)} orphan "
        f"blobs, {s.hits} hits / {s.misses} misses, {len(s.failures)} given up, "
        f"{len(s.warnings)} warnings ({s.root})"
    )
    click.echo(f"max size: {format_size(limit)} ({app.max_size_source}), {s.size_on_disk_str} used"
               + ("; over it: the next put or `aotc gc` evicts what is not in use"
                  if s.size_on_disk > limit else "")
               if limit is not None else f"max size: none, {s.size_on_disk_str} used")
    _echo_warnings(s.warnings, verbose)


_SHOWN_WARNINGS = 20


def _echo_warnings(warnings: Any, verbose: bool) -> None:
    """The scan's warnings on stderr: the first 20 and how many more (all with ``-v``; ``--json``
    lists them all) — a damaged store of 100,000 entries is not 100,000 lines."""
    shown = list(warnings) if verbose else list(warnings)[:_SHOWN_WARNINGS]
    for w in shown:
        click.echo(f"warning: {w}", err=True)
    if len(warnings) > len(shown):
        click.echo(f"warning: … and {len(warnings) - len(shown)} more (-v shows every one, "
                   "--json lists them)", err=True)


def _inspect_remote(app: AppContext, as_json: bool, verbose: bool) -> None:
    from aotc.fleet.remote_scan import scan_remote

    s = scan_remote(app.remote(required="inspect cache"))
    if as_json:
        print_json(s.to_json())
        return
    click.echo(_entry_table(s.entries, verbose, remote=True) if s.entries
               else f"remote store {s.url} is empty")
    click.echo(f"\n{len(s.entries)} entries, {s.blob_count} blobs ({format_size(s.blob_bytes)}), "
               f"{s.orphan_blobs} unreferenced blobs, {len(s.warnings)} warnings ({s.url})")
    _echo_warnings(s.warnings, verbose)


@click.command("verify")
@click.option("--repair", is_flag=True, help="Evict bad entries, orphan blobs and stale staging files.")
@click.option("--signatures", is_flag=True,
              help="Also report each entry's signature state; exit 1 if a trust policy is set "
                   "and an entry is not signed by a trusted key.")
@trust_option
@json_option
@pass_app
@guard
def verify_command(app: AppContext, repair: bool, signatures: bool, trust: tuple[str, ...],
                   as_json: bool) -> None:
    """Re-hash every blob; exit 1 when any entry is corrupt or missing a blob. On a remote store
    every blob is downloaded; --repair deletes damaged blobs and the entries needing them."""
    if app.store_is_remote:
        if signatures or trust:
            raise click.UsageError("--signatures / --trust check a local store; `aotc pull "
                                   "--trust KEY` checks a remote entry's signatures as it pulls")
        return _verify_remote(app, repair, as_json)
    report = maintenance.verify_at(app.store_path, repair=repair)
    sig_rows, untrusted = None, False
    if (signatures or trust) and (report.index_problem is None or repair):
        from aotc.fleet.trust import signature_report

        policy = app.policy(trust)
        sig_rows = signature_report(app.store, policy)
        untrusted = bool(policy.keys) and any(r["state"] != "trusted" for r in sig_rows)
    if as_json:
        out = report.to_json()
        if sig_rows is not None:
            out["signatures"] = sig_rows
        print_json(out)
    else:
        for r in sig_rows or []:
            click.echo(f"{r['key'][:16]}… {r['name']}: {r['state']}"
                       + (f" (signed by {', '.join(k[:16] + '…' for k in r['signers'])})"
                          if r["signers"] else ""))
        for p in report.problems:
            click.echo(p.describe())
        state = ("clean" if report.ok else "the index file is damaged" if report.index_problem
                 and not repair else f"{len(report.bad_keys)} bad entries")
        click.echo(
            f"verified {report.entries_checked} entries, {report.blobs_checked} blobs, "
            f"{format_size(report.bytes_checked)}: {state}"
            + (f"; repaired, freed {format_size(report.freed)}" if repair else "")
        )
        if not report.ok and not repair:
            echo_err("run `aotc verify --repair` to evict the bad entries (recompile them after)")
    if (not report.ok and not repair) or untrusted:
        sys.exit(1)


def _verify_remote(app: AppContext, repair: bool, as_json: bool) -> None:
    from aotc.fleet.remote_scan import verify_remote

    report = verify_remote(app.remote(required="verify"), repair=repair)
    if as_json:
        print_json(report.to_json())
    else:
        for p in report.problems:
            click.echo(p)
        state = "clean" if report.ok else f"{len(report.bad_keys)} bad entries"
        click.echo(f"verified {report.entries_checked} entries, {report.blobs_checked} blobs, "
                   f"{format_size(report.bytes_checked)} downloaded: {state} ({report.url})"
                   + (f"; removed {len(report.removed)} objects" if repair and report.removed else ""))
        if not report.ok and not repair:
            echo_err("run `aotc verify --repair` to remove them, then push them again")
    if not report.ok and not repair:
        sys.exit(1)


@click.command("gc")
@click.option("--max-size", default=None, metavar="SIZE",
              help="Evict least recently used entries until the store fits (e.g. 10G, 500M; "
                   "default: the store's bound, aotc --max-size or $AOTC_MAX_SIZE, if any).")
@click.option("--dry-run", is_flag=True, help="Print what would be freed; delete nothing.")
@click.option("--tmp-grace", default=maintenance.DEFAULT_TMP_GRACE, type=float, show_default=True,
              help="Seconds a staging file must be idle before it counts as garbage.")
@click.option("--min-idle", default=maintenance.DEFAULT_MIN_IDLE, type=float, show_default=True,
              help="Seconds since an entry was last written or read before it may be evicted "
                   "(protects loaders reading it).")
@json_option
@pass_app
@guard
def gc_command(app: AppContext, max_size: str | None, dry_run: bool, tmp_grace: float,
               min_idle: float, as_json: bool) -> None:
    """Remove orphan blobs, stale staging files, lock files of entries that are gone and, with
    --max-size (or the store's bound), the least recently used entries nobody holds."""
    app.local_only("gc")
    try:
        limit = app.settings.max_size if max_size is None else maintenance.parse_size(max_size)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--max-size") from None
    if min_idle < 0:
        raise click.BadParameter("must be >= 0", param_hint="--min-idle")
    plan = maintenance.plan_gc(app.store, max_size=limit, tmp_grace=tmp_grace, min_idle=min_idle)
    freed = 0 if dry_run else plan.execute()
    if as_json:
        out = plan.to_json()
        out.update(dry_run=dry_run, freed=freed)
        print_json(out)
        return
    verb = "would free" if dry_run else "freed"
    for e in plan.entries:
        click.echo(f"evict {e.name} {e.key_short} ({e.stored_size_str}, last used {e.last_used_str})")
    click.echo(
        f"{verb} {format_size(plan.expected_freed_size if dry_run else freed)}: "
        f"{len(plan.entries)} entries, {len(plan.orphan_blobs)} orphan blobs, "
        f"{len(plan.tmp_files)} staging files (store was {format_size(plan.size_before)})"
    )
    if plan.failures:
        click.echo(f"{'would forget' if dry_run else 'forgot'} {len(plan.failures)} remembered failures: "
                   "those graphs are tried again")
    if plan.protected:
        click.echo(f"kept {len(plan.protected)} entries over --max-size that were written or read "
                   f"in the last {plan.min_idle:g}s (--min-idle; a loader may be reading them) "
                   "or that a running process holds: "
                   + ", ".join(f"{e.name} {e.key_short}" for e in plan.protected[:5])
                   + (" …" if len(plan.protected) > 5 else ""))
