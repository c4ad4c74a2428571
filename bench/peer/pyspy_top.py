"""The threads and functions of a py-spy recording (`py-spy record --format raw --threads`, as
video_server_peer.py's $PYSPY samples the server), as a short table:

    python bench/peer/pyspy_top.py OUT/pyspy/hylora-all-gil.txt [--rate 200] [--wall 11.7] [--top 12]   # or .txt.xz

Per thread (pools merged by name): its samples, and with --rate and --wall the share of the wall they
cover (in a --gil recording: how long that thread held the GIL). Then each busy thread's leaf functions
(where the samples were taken) and, for the engine thread, the hylora functions on its stacks.
"""

from __future__ import annotations

import argparse
import lzma
import re
from collections import Counter, defaultdict
from pathlib import Path

POOL_SUFFIX = re.compile(r"_\d+$")  # ThreadPoolExecutor names its threads <prefix>_<n>


def read(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread name, frames root first, samples) per line."""
    rows = []
    text = lzma.decompress(path.read_bytes()).decode() if path.suffix == ".xz" else path.read_text()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        name = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else "?"
        rows.append((POOL_SUFFIX.sub("", name), frames[1:], int(count)))
    return rows


def short(frame: str) -> str:
    """`fn (pkg/file.py:12)` without the line number."""
    return re.sub(r":\d+\)$", ")", frame)


def report(rows: list[tuple[str, list[str], int]], rate: float | None, wall: float | None, top: int) -> str:
    per_thread: Counter[str] = Counter()
    leaves: dict[str, Counter[str]] = defaultdict(Counter)
    inclusive: dict[str, Counter[str]] = defaultdict(Counter)
    for name, frames, n in rows:
        per_thread[name] += n
        if frames:
            leaves[name][short(frames[-1])] += n
        for f in {short(f) for f in frames if "hylora/" in f}:
            inclusive[name][f] += n
    total = sum(per_thread.values())
    ticks = rate * wall if rate and wall else None
    out = [f"{total} samples" + (f" over {wall:.1f} s at {rate:.0f}/s ({ticks:.0f} ticks)" if ticks else ""), ""]
    out += ["| thread | samples | share of samples | share of the wall |", "| --- | --- | --- | --- |"]
    for name, n in per_thread.most_common():
        wall_share = f"{n / ticks:.0%}" if ticks else "–"
        out.append(f"| {name} | {n} | {n / total:.0%} | {wall_share} |")
    for name, _ in per_thread.most_common(4):
        out += ["", f"{name}: leaf functions", ""]
        out += [f"  {c:6d}  {f}" for f, c in leaves[name].most_common(top)]
        if "engine" in name:
            out += ["", f"{name}: hylora functions on the stack", ""]
            out += [f"  {c:6d}  {f}" for f, c in inclusive[name].most_common(top)]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path)
    p.add_argument("--rate", type=float, default=200.0, help="py-spy's --rate (video_server_peer: 200)")
    p.add_argument("--wall", type=float, default=None, help="the recording's seconds, for the share of the wall")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    print(report(read(args.path), args.rate, args.wall, args.top))


if __name__ == "__main__":
    main()
