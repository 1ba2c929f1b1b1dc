"""`tracedeck export` and `tracedeck dsa whatif|tiers`: a collected DSA trace turned into answers."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runners.exits import EXIT_INFRA, EXIT_USAGE

DEFAULT_SIZES = "4,8,16,64,128"


def add_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    export = sub.add_parser(
        "export", help="write a DSA trace's records as parquet or csv (invalid ones marked)"
    )
    export.add_argument("dir", type=Path, help="a DSA --trace-out directory or one block<N>/")
    export.add_argument(
        "--format",
        choices=("parquet", "csv"),
        default="parquet",
        help="parquet (zstd: as fast as snappy or lz4 here, smallest files) or csv",
    )
    export.add_argument(
        "--output", type=Path, help="file to write (default: DIR/<block>.<format> beside it)"
    )
    export.add_argument("--topk", type=int, help="top-k when summary.json does not say")
    export.add_argument(
        "--workers",
        type=int,
        help="processes reading the trace (default: for csv as many as cores and memory allow; "
        "for parquet 1, as each record is compressed here)",
    )

    dsa = sub.add_parser("dsa", help="DSA trace data tools: block-size what-if, KV-tier simulator")
    tools = dsa.add_subparsers(
        dest="dsa_command", required=True, help="whatif (block sizes) or tiers (KV tiers)"
    )
    whatif = tools.add_parser(
        "whatif", help="seed 004's block fields recomputed at other block sizes, from one trace"
    )
    whatif.add_argument("dir", type=Path)
    whatif.add_argument("--block-sizes", default=DEFAULT_SIZES, help=f"(default {DEFAULT_SIZES})")
    whatif.add_argument("--topk", type=int, help="top-k when summary.json does not say")
    whatif.add_argument("--json", action="store_true", help="print the result as JSON")
    whatif.add_argument(
        "--workers",
        type=int,
        help="processes reading the trace (default: as many as cores and memory allow)",
    )

    tiers = tools.add_parser(
        "tiers", help="replay the block accesses through an HBM tier of N blocks over a remote pool"
    )
    tiers.add_argument("dir", type=Path)
    tiers.add_argument(
        "--hbm-blocks", required=True, help="HBM capacity in blocks: N, or N1,N2,... for a curve"
    )
    tiers.add_argument(
        "--sweep", action="store_true", help="capacities 1, 2, 4, ... up to the largest N"
    )
    tiers.add_argument("--policy", choices=("lru", "lfu", "prefix-pinned"), default="lru")
    tiers.add_argument(
        "--remote-latency-us",
        type=float,
        default=50.0,
        help="per remote batch_get (an assumption; default 50)",
    )
    tiers.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=25.0,
        help="remote pool bandwidth in GB/s (an assumption; default 25)",
    )
    tiers.add_argument(
        "--block-size", type=int, help="replay at another block size (from the positions)"
    )
    tiers.add_argument(
        "--kv-bytes-per-token", type=int, help="when the trace does not show it (bytes_read 0)"
    )
    tiers.add_argument("--topk", type=int, help="top-k when summary.json does not say")
    tiers.add_argument("--json", action="store_true", help="print the result as JSON")
    tiers.add_argument(
        "--workers",
        type=int,
        help="processes reading the trace (default 1: the replay runs here, in order)",
    )


def sizes_of(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"--block-sizes: {part!r} is not a block size (an integer >= 1)")
        if int(part) not in out:
            out.append(int(part))
    if not out:
        raise ValueError("--block-sizes: give at least one block size")
    return out


def _err(message: str) -> None:
    print(f"tracedeck: {message}", file=sys.stderr)


def _unreadable(folder: Path, exc: OSError) -> str:
    """What an OSError raised while a block directory's files were read says, naming the file."""
    where = exc.filename or folder
    return (
        f"{where}: cannot read ({exc.strerror or exc}); each trace_steps_*.jsonl in {folder} "
        "must be a readable file: fix or move it out of the block directory"
    )


def _topk_hint(info: Any) -> str:
    """When the records were checked against a top-k nobody stated: how to give the right one."""
    if info.topk_from.startswith("the seed's"):
        return (
            f"; top-k was not stated (no summary.json config.index_topk), so each record was "
            f"checked against the seed's production top-{info.topk}: if the engine ran with "
            "another, give it with --topk"
        )
    return ""


def _folders(path: Path) -> list[Path] | None:
    from analysis.dsa_scan import trace_folders
    from analysis.dsa_tree import NotATrace

    if not path.is_dir():
        _err(f"{path}: no such directory; pass a DSA --trace-out directory or one block<N>/ in it")
        return None
    try:
        return trace_folders(path)
    except NotATrace as exc:
        _err(str(exc))
        return None


def _outputs(folders: list[Path], output: Path | None, fmt: str) -> list[Path] | str:
    """Where each block directory's export goes (or why it cannot)."""
    if output is None:
        return [f.parent / f"{f.name}.{fmt}" for f in folders]
    if len(folders) == 1 and not output.is_dir():
        return [output]
    if output.exists() and not output.is_dir():
        return f"--output {output}: {len(folders)} block directories need a directory to go in"
    output.mkdir(parents=True, exist_ok=True)
    return [output / f"{f.name}.{fmt}" for f in folders]


def cmd_export(args: argparse.Namespace) -> int:
    """Exit 0: every record exported and valid; 1: exported, some marked invalid; 2: usage;
    3: a worker process died."""
    from analysis.dsa_parallel import WorkerError
    from analysis.dsa_scan import trace_info
    from runners.resources import dsa_workers

    folders = _folders(args.dir)
    if folders is None:
        return EXIT_USAGE
    outs = _outputs(folders, args.output, args.format)
    if isinstance(outs, str):
        _err(outs)
        return EXIT_USAGE
    for folder, out in zip(folders, outs, strict=True):  # every one before any is written
        if out.resolve().is_relative_to(folder.resolve()):
            _err(f"--output {out}: inside the block directory {folder}; name a file outside it")
            return EXIT_USAGE
    any_invalid = False
    for folder, out in zip(folders, outs, strict=True):
        try:
            info = trace_info(folder, args.topk)
            records, invalid = export_block(
                info,
                out,
                args.format,
                dsa_workers(args.workers, answers_heavy=args.format == "parquet"),
            )
        except WorkerError as exc:
            _err(f"{folder}: not exported: {exc}")
            return EXIT_INFRA
        except OSError as exc:  # first: a file that is no regular one is a ValueError too
            if exc.filename is not None and Path(exc.filename).parent == folder:
                _err(f"{_unreadable(folder, exc)}; {out} not written")
            else:
                _err(f"{out}: cannot write ({exc.strerror or exc})")
            return EXIT_USAGE
        except ValueError as exc:
            _err(str(exc))
            return EXIT_USAGE
        if records == 0:
            _err(
                f"{folder}: no trace line in its shards: nothing exported ({out} not written); "
                "`tracedeck analyze` says what the directory holds"
            )
            return EXIT_USAGE
        any_invalid = any_invalid or invalid > 0
        note = f", {invalid} marked invalid (valid = false, with the reason)" if invalid else ""
        note += _topk_hint(info) if invalid else ""
        print(f"{folder}: {records} records -> {out}{note}")
    return 1 if any_invalid else 0


ROW_GROUP = 1024  # rows buffered before a parquet row group is written (~17 MiB at top-2048;
# the last group is written after the records end, alone: 4096 made that wait ~10% of an export)


def export_block(
    info, out: Path, fmt: str, workers: int = 1, chunk: int = 4 << 20
) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Stream a block directory's records into one file (written to a part file of its own,
    then renamed; none when its shards hold no line).

    The chunks are parsed, judged and made tables by `workers` processes
    (analysis.dsa_parallel; here when 1), in order; their encoding (parquet's, or csv's
    text where the workers did not make it: pyarrow, mostly outside the GIL) runs in one
    writer thread meanwhile; at most one write is in flight and a few chunks wait per worker
    (bounded memory)."""
    import os
    import secrets
    from concurrent.futures import Future, ThreadPoolExecutor

    import pyarrow as pa
    import pyarrow.parquet as pq

    from analysis.dsa_export import (
        PARQUET_OPTIONS,
        SCHEMA,
        ExportChunk,
        csv_rows,
        csv_text,
        flat_for_csv,
    )
    from analysis.dsa_parallel import map_chunks
    from analysis.dsa_scan import known
    from analysis.dsa_tree import shard_files

    # this export's own part file: two exports to one output never write into each other's;
    # named before it is made, so a signal at any point after `try` leaves none behind
    part = out.with_name(f"{out.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    records = invalid = 0
    pending: list[pa.Table] = []
    inflight: Future[Any] | None = None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export")
    sink: Any = None

    def put(payload: Any) -> None:
        nonlocal inflight
        if inflight is not None:
            inflight.result()  # one write at a time, and its error surfaces here
        inflight = pool.submit(write, payload)

    try:
        os.close(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # (the umask's)
        if fmt == "parquet":
            sink = pq.ParquetWriter(part, SCHEMA, **PARQUET_OPTIONS)
            write = sink.write_table
        else:
            sink = part.open("wb")
            sink.write(csv_text(flat_for_csv(SCHEMA.empty_table()), header=True))

            def write(got: pa.Table | pa.Buffer) -> None:
                sink.write(csv_rows(got) if isinstance(got, pa.Table) else got)

        # one process: the text is made in the writer thread, beside the next chunk's parse;
        # several: by the workers, which then share that work too
        job = ExportChunk(info, csv=fmt == "csv", text=fmt == "csv" and workers > 1)
        files = shard_files(info.folder)
        for payload, rows, bad in map_chunks(files, job, workers, lambda: known(info), chunk):
            records += rows
            invalid += bad
            if fmt == "csv":
                put(payload)
                continue
            pending.append(payload)
            if sum(t.num_rows for t in pending) >= ROW_GROUP:
                put(pa.concat_tables(pending))
                pending.clear()
        if pending:
            put(pa.concat_tables(pending))
        if inflight is not None:
            inflight.result()
        sink.close()
        sink = None
        if records:  # nothing to export: no file (the caller says so)
            part.replace(out)
    finally:
        try:
            pool.shutdown(wait=True)
            if sink is not None:
                sink.close()
        finally:  # whatever closing a broken export raised, its part file goes
            part.unlink(missing_ok=True)
    return records, invalid


def cmd_dsa(args: argparse.Namespace) -> int:
    if args.dsa_command == "whatif":
        return cmd_whatif(args)
    if args.dsa_command == "tiers":
        return cmd_tiers(args)
    raise AssertionError(args.dsa_command)


def cmd_whatif(args: argparse.Namespace) -> int:
    from analysis.dsa_whatif import format_whatif, whatif_dir
    from runners.resources import dsa_workers

    try:
        sizes = sizes_of(args.block_sizes)
    except ValueError as exc:
        _err(str(exc))
        return EXIT_USAGE
    return _each_folder(
        args,
        lambda folder: whatif_dir(str(folder), sizes, args.topk, dsa_workers(args.workers)),
        format_whatif,
        "no valid dsa_topk record to recompute from",
    )


def _each_folder(
    args: argparse.Namespace,
    compute: Callable[[Path], dict[str, Any]],
    fmt: Callable[[dict[str, Any]], str],
    nothing: str,
) -> int:
    """compute() each block folder of args.dir, print the results (JSON or text); a folder that
    cannot be read, or no valid record anywhere, is a usage error."""
    folders = _folders(args.dir)
    if folders is None:
        return EXIT_USAGE
    from analysis.dsa_parallel import WorkerError

    results = []
    for folder in folders:
        try:
            results.append(compute(folder))
        except OSError as exc:  # first: a file that is no regular one is a ValueError too
            _err(_unreadable(folder, exc))
            return EXIT_USAGE
        except ValueError as exc:
            _err(str(exc))
            return EXIT_USAGE
        except WorkerError as exc:
            _err(f"{folder}: not computed: {exc}")
            return EXIT_INFRA
    if args.json:
        print(json.dumps({"dirs": results}, indent=1))
    else:
        print("\n\n".join(fmt(r) for r in results))
    if not any(r["used"] for r in results):
        from analysis.dsa_scan import trace_info

        hint = "".join(_topk_hint(trace_info(f, args.topk)) for f in folders[:1])
        _err(f"{nothing} (`tracedeck analyze DIR` says why){hint}")
        return EXIT_USAGE
    return 0


def capacities_of(text: str, sweep: bool) -> list[int]:
    out = sorted(set(sizes_of(text)))
    if sweep:
        top, n, out = max(out), 1, []
        while n < top:
            out.append(n)
            n *= 2
        out.append(top)
    return out


def cmd_tiers(args: argparse.Namespace) -> int:
    from analysis.dsa_scan import trace_info
    from analysis.dsa_tiers import format_tiers, tiers_dir
    from runners.resources import dsa_workers

    try:
        caps = capacities_of(args.hbm_blocks, args.sweep)
    except ValueError:
        _err(f"--hbm-blocks {args.hbm_blocks!r}: give block counts >= 1 (N or N1,N2,...)")
        return EXIT_USAGE
    if args.block_size is not None and args.block_size < 1:
        _err(f"--block-size {args.block_size}: must be >= 1")
        return EXIT_USAGE
    if args.remote_latency_us < 0 or args.bandwidth_gbs <= 0:
        _err("--remote-latency-us must be >= 0 and --bandwidth-gbs > 0")
        return EXIT_USAGE
    return _each_folder(
        args,
        lambda folder: tiers_dir(
            trace_info(folder, args.topk),
            caps,
            args.policy,
            block_size=args.block_size,
            bytes_per_token=args.kv_bytes_per_token,
            remote_latency_us=args.remote_latency_us,
            bandwidth_gbs=args.bandwidth_gbs,
            workers=dsa_workers(args.workers, answers_heavy=True),
        ),
        format_tiers,
        "no valid dsa_topk record to replay",
    )
