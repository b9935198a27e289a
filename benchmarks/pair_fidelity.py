"""Methods of separate `benchmarks.eviction_fidelity --per-position` runs, paired against a
reference that may be several runs of one method: its mean over them, passage by passage.

A press whose choices move with float rounding (SnapKV pools and ranks near-equal scores) gives
one draw of its KL per run; runs that force other instruction sets
(``ATEN_CPU_CAPABILITY``, ``MKL_CBWR``) are more draws on the same CPU and passages, and their
mean is what a method is compared with. Each source is ``FILE`` or ``FILE::LABEL`` (a method's
name in the file, e.g. ``kvpress-snapkv 0.3``; without it, the file's only method besides
``full``).

    python -m benchmarks.pair_fidelity --length 4096 \\
        --reference A.json::'kvpress-snapkv 0.3' --reference B.json --method C.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.eviction_fidelity import paired


def load(source: str, length: int) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(name, top-1, KL) of one method in a per-position file, [passages, positions] each."""
    path, _, label = source.partition("::")
    runs = json.loads(Path(path).read_text())
    if str(length) not in runs:
        raise ValueError(f"{path}: no length {length} (it has {', '.join(runs)})")
    methods = runs[str(length)]["methods"]
    names = [label] if label else [name for name in methods if name != "full"]
    if len(names) != 1 or names[0] not in methods:
        raise ValueError(f"{source}: name one of {', '.join(methods)} after '::'")
    values = methods[names[0]]
    return names[0], torch.tensor(values["top1"]), torch.tensor(values["kl"])


def table(references: list[tuple], methods: list[tuple]) -> str:
    """Each reference draw, their mean, and each method with its difference from the mean (95 %
    half-width over passages)."""
    top1 = torch.stack([ref[1] for ref in references]).mean(0)
    kl = torch.stack([ref[2] for ref in references]).mean(0)
    lines = [
        "| method | top-1 | top-1 − reference (95 % CI) | KL (nats) | KL − reference (95 % CI) |"
        " KL / reference |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = [(f"reference {i + 1}", *r) for i, r in enumerate(references)]
    rows += [(f"method {i + 1}", *m) for i, m in enumerate(methods)]
    for source, name, row_top1, row_kl in rows:
        lines.append(
            f"| {source}: {name} | {float(row_top1.mean()):.4f} | {_paired(row_top1, top1)} "
            f"| {float(row_kl.mean()):.4f} | {_paired(row_kl, kl)} "
            f"| {float(row_kl.mean()) / float(kl.mean()):.3f}× |"
        )
    lines.append(
        f"| reference: mean of {len(references)} | {float(top1.mean()):.4f} | | "
        f"{float(kl.mean()):.4f} | | 1.000× |"
    )
    return "\n".join(lines)


def _paired(values: torch.Tensor, reference: torch.Tensor) -> str:
    mean, half_width = paired(values, reference)
    return f"{mean:+.4f}" + ("" if half_width is None else f" ± {half_width:.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, required=True)
    parser.add_argument("--reference", action="append", required=True, help="FILE[::LABEL]")
    parser.add_argument("--method", action="append", default=[], help="FILE[::LABEL]")
    args = parser.parse_args(argv)

    def load_each(flag: str, sources: list[str]) -> list[tuple]:
        try:
            return [load(source, args.length) for source in sources]
        except (OSError, ValueError) as error:
            parser.error(f"{flag}: {error}")

    references = load_each("--reference", args.reference)
    methods = load_each("--method", args.method)
    shapes = {tuple(values[2].shape) for values in [*references, *methods]}
    if len(shapes) != 1:
        parser.error(f"the files' passages and positions differ: {sorted(shapes)}")
    print(table(references, methods))


if __name__ == "__main__":
    main()
