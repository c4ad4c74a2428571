"""Drop the fatbin entries an H200 (sm_90) never loads from a CUDA shared library, so that vLLM's
`_C` libraries fit the GPU run's 64 MiB carry (88 MB -> 15 MB after xz).

Each `.nv_fatbin` container keeps its start (the registration wrapper points there); the kept
entries move up, the container's size shrinks and its freed tail is zeroed. Kept: sm_90 SASS; PTX
(arch <= 90) in containers without sm_90 SASS; in a container that would be empty, its smallest
entry. (From the vLLM peer harness, where the pruned library listed cleanly with cuobjdump and
its 46 sm_90 cubins were byte-identical to the original's.)

    python3 bench/peer/prune_fatbin.py SRC.so DST.so
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Iterator
from pathlib import Path

MAGIC = 0xBA55ED50
SASS, PTX = 2, 1


def sections(d: bytes) -> dict[str, tuple[int, int]]:
    """ELF section name -> (file offset, size)."""
    e_shoff = struct.unpack_from("<Q", d, 0x28)[0]
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", d, e_shoff + i * e_shentsize) for i in range(e_shnum)]
    strings = headers[e_shstrndx][4]
    return {
        d[strings + name : d.index(b"\0", strings + name)].decode(): (offset, size)
        for name, _, _, _, offset, size in headers
    }


def containers(d: bytes) -> Iterator[tuple[int, list[dict[str, int]]]]:
    """(offset, entries) of each fatbin container in `.nv_fatbin`."""
    off, size = sections(d)[".nv_fatbin"]
    p, end = off, off + size
    while p < end:
        magic, _, header, body = struct.unpack_from("<IHHQ", d, p)
        if magic != MAGIC:
            p += 8
            continue
        entries, q = [], p + header
        while q < p + header + body:
            kind, _, ehs, esz, _, _, _, _, arch = struct.unpack_from("<HHIQIIHHI", d, q)
            entries.append(dict(pos=q, kind=kind, hs=ehs, size=esz, arch=arch))
            q += ehs + esz
        yield p, entries
        p += header + body


def prune(src: Path, dst: Path) -> None:
    d = bytearray(src.read_bytes())
    before = after = 0
    for p, entries in list(containers(bytes(d))):
        _, _, header, body = struct.unpack_from("<IHHQ", d, p)
        has90 = any(e["kind"] == SASS and e["arch"] == 90 for e in entries)
        keep = [
            e
            for e in entries
            if (e["kind"] == SASS and e["arch"] == 90) or (e["kind"] == PTX and e["arch"] <= 90 and not has90)
        ] or [min(entries, key=lambda e: e["hs"] + e["size"])]
        blob = b"".join(bytes(d[e["pos"] : e["pos"] + e["hs"] + e["size"]]) for e in keep)
        d[p + header : p + header + body] = blob + bytes(body - len(blob))
        struct.pack_into("<Q", d, p + 8, len(blob))
        before, after = before + body, after + len(blob)
    dst.write_bytes(d)
    print(f"{src.name}: fatbin payload {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB")


if __name__ == "__main__":
    prune(Path(sys.argv[1]), Path(sys.argv[2]))
