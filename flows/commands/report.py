"""``vse report`` (stage ``report``): all models side by side."""

from __future__ import annotations

from pathlib import Path

from flows.commands import command, path_in, path_out
from infra.config import UserError


def report_arguments(p) -> None:
    path_in(
        p,
        "results",
        nargs="+",
        help="evaluation JSON files (vse evaluate --out), or their folder: MODEL.json of "
        "each model of models.enabled and RUN.json of each run of models.ablations (and of "
        "--histories; --galleries: the enabled models only)",
    )
    path_out(p, "--out", help="markdown report to write")
    path_out(p, "--plot", help="PNG bar plot to write")
    path_in(
        p, "--histories", nargs="+", help="per-epoch JSON rows of each model (vse train --plots)"
    )
    path_out(p, "--curves", required=False, help="PNG of every model's training curves")
    path_in(p, "--galleries", nargs="+", help="gallery JSON of each model (vse evaluate --gallery)")
    path_in(p, "--manifest", help="manifest (image paths), with --galleries")
    path_in(p, "--images", help="images root of the manifest, with --galleries")
    path_in(p, "--extremes", help="Sentence-BERT extremes JSON (vse stats sbert --examples)")
    path_out(p, "--gallery-html", required=False, help="the gallery page to write (one file)")
    path_out(p, "--gallery-pngs", required=False, help="folder for the gallery's PNGs")


def model_files(paths: list[str] | None, enabled) -> list[Path]:
    """Each path as given; a folder becomes ``FOLDER/NAME.json`` for each name of
    ``enabled``: the models of ``models.enabled`` and the runs of ``models.ablations`` (so
    dvc.yaml's report follows those lists)."""
    out: list[Path] = []
    for path in map(Path, paths or []):
        out += [path / f"{m}.json" for m in enabled] if path.is_dir() else [path]
    return out


@command(
    "report",
    help="one table of all models on the same split, with the papers' numbers",
    arguments=report_arguments,
    sections=("models",),
)
def run_report(args, params) -> None:
    from models.report.table import write_report

    enabled = list(params.models.enabled)
    rows = enabled + list(params.models.ablations)
    args.results, args.histories, args.galleries = (
        model_files(args.results, rows),
        model_files(args.histories, rows),
        model_files(args.galleries, enabled),
    )
    if args.histories and not args.curves:
        raise UserError("--histories needs --curves PNG, where the training curves go")
    curves = Path(args.curves) if args.curves else None
    print(write_report(args.results, Path(args.out), Path(args.plot), args.histories, curves))
    print(f"report -> {args.out}, {args.plot}" + (f", {curves}" if curves else ""))
    if args.galleries:
        from models.report.table import write_galleries

        needed = ("manifest", "images", "gallery_html", "gallery_pngs")
        missing = [f"--{n.replace('_', '-')}" for n in needed if not getattr(args, n)]
        if missing:
            raise UserError(f"--galleries needs {', '.join(missing)}")
        pngs = write_galleries(
            args.galleries,
            Path(args.manifest),
            Path(args.images),
            Path(args.extremes) if args.extremes else None,
            Path(args.gallery_html),
            Path(args.gallery_pngs),
        )
        print(
            f"report: gallery -> {args.gallery_html} ({len(pngs)} pictures in {args.gallery_pngs})"
        )
