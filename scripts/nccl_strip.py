"""Shrink libnccl.so.2 to one GPU architecture, so that NCCL >= 2.30 fits the 64 MiB a GPU check may carry.

Why: two ranks can share one GPU only with NCCL >= 2.30 (``NCCL_MULTI_RANK_GPU_ENABLE``), the lent GPU image has
2.28.9 and no network, and the NCCL wheel is 305 MB (libnccl.so.2 344 MB): nearly all of it is device code for
every architecture from sm_75 to sm_120. A GPU loads only the image built for its own architecture, so zeroing
every other image leaves a library that behaves the same on that GPU, and xz shrinks the zeros to nothing.

How, strictly (anything unexpected is refused with a message naming the value, never guessed around):
- the ELF64 little-endian section table names the device-code sections (``.nv_fatbin``, ``__nv_relfatbin``);
- each section is a sequence of fatbin containers: u32 magic 0xBA55ED50, u16 version 1, u16 header size 16,
  u64 size of the entries that follow; the containers must tile the section (zero padding < 16 bytes allowed);
- each entry: u16 kind (1 PTX, 2 ELF cubin), u16, u32 header size (>= 32), u64 payload size, and its
  architecture as a u32 at byte 28 (90 = sm_90); the entries must tile their container exactly;
- every payload whose architecture is not the kept one is zeroed; headers stay, so every offset stays valid;
- the result is parsed again: other payloads all zero, kept payloads byte-identical, at least one kept.

    python scripts/nccl_strip.py strip IN OUT --arch 90          # one library
    python scripts/nccl_strip.py prepare WHEEL OUT_DIR --arch 90  # a wheel -> OUT_DIR/libnccl.so.2.xz + manifest
    python scripts/nccl_strip.py inspect LIB                      # the arches in a library, per section

``--arch`` is the GPU's compute capability without the dot: 90 for H100/H200 (sm_90), 100 for B200, 80 for A100;
``nvidia-smi --query-gpu=compute_cap --format=csv,noheader`` prints it with the dot (9.0).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import struct
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

FATBIN_MAGIC = 0xBA55ED50
CONTAINER_HEADER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries
ENTRY_HEADER = struct.Struct("<HHIQ")  # kind, (unused here), header size, payload size
ARCH_OFFSET = 28  # u32 architecture inside an entry header
MIN_ENTRY_HEADER = ARCH_OFFSET + 4
FATBIN_SECTIONS = (".nv_fatbin", "__nv_relfatbin")
KINDS = {1: "PTX", 2: "ELF", 4: "IR"}
MAX_PADDING = 16  # zero bytes tolerated between containers (alignment)
LIBRARY = "libnccl.so.2"
ARTIFACT = LIBRARY + ".xz"
MANIFEST = "manifest.json"
WHEEL_MEMBER = "nvidia/nccl/lib/" + LIBRARY


class FatbinError(ValueError):
    """The file is not laid out as this tool expects: nothing is written."""


@dataclass(frozen=True)
class Section:
    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class Entry:
    section: str
    container: int  # file offset of its container
    offset: int  # file offset of the entry header
    kind: int
    header_size: int
    payload_size: int
    arch: int

    @property
    def payload(self) -> tuple[int, int]:
        start = self.offset + self.header_size
        return start, start + self.payload_size


@dataclass
class StripReport:
    arch: int
    size: int = 0
    kept_bytes: dict[int, int] = field(default_factory=dict)  # arch -> payload bytes kept (only ``arch``)
    zeroed_bytes: dict[int, int] = field(default_factory=dict)  # arch -> payload bytes zeroed
    kept_entries: int = 0
    zeroed_entries: int = 0
    containers: int = 0
    containers_without_arch: int = 0  # they had no image for this GPU before stripping either
    sections: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        mb = 1e6
        zeroed = ", ".join(f"sm_{a} {b / mb:.1f} MB" for a, b in sorted(self.zeroed_bytes.items()))
        return [f"kept sm_{self.arch}: {sum(self.kept_bytes.values()) / mb:.1f} MB in {self.kept_entries} images; "
                f"zeroed {self.zeroed_entries} images of other arches ({zeroed})",
                f"{self.containers} fatbin containers in {', '.join(self.sections)}; "
                f"{self.containers_without_arch} hold no sm_{self.arch} image (none before stripping either)"]


def _u(fmt: str, data: bytes | bytearray, offset: int, what: str) -> tuple[int, ...]:
    size = struct.calcsize(fmt)
    if offset < 0 or offset + size > len(data):
        raise FatbinError(f"{what} at offset {offset:#x} runs past the end of the file ({len(data)} bytes)")
    return struct.unpack_from(fmt, data, offset)


def elf_sections(data: bytes | bytearray) -> list[Section]:
    """The sections of a 64-bit little-endian ELF file, with names; FatbinError for anything else."""
    if bytes(data[:4]) != b"\x7fELF":
        raise FatbinError(f"not an ELF file (first bytes {bytes(data[:4])!r})")
    if data[4] != 2 or data[5] != 1:
        raise FatbinError(f"only 64-bit little-endian ELF is handled (class {data[4]}, data {data[5]})")
    (shoff,) = _u("<Q", data, 0x28, "e_shoff")
    shentsize, shnum, shstrndx = _u("<HHH", data, 0x3A, "e_shentsize/e_shnum/e_shstrndx")
    if shentsize != 64:
        raise FatbinError(f"ELF section header size {shentsize}, expected 64")
    if not 0 < shnum or shstrndx >= shnum:
        raise FatbinError(f"ELF section count {shnum} / name table index {shstrndx} are not usable")
    raw = []
    for i in range(shnum):
        name, kind, _flags, _addr, offset, size = _u("<IIQQQQ", data, shoff + 64 * i, f"section header {i}")
        raw.append((name, kind, offset, size))
    _, _, str_off, str_size = raw[shstrndx]
    if str_off + str_size > len(data):
        raise FatbinError("the ELF section name table lies outside the file")
    sections = []
    for name_off, kind, offset, size in raw:
        end = data.find(b"\0", str_off + name_off, str_off + str_size)
        name = bytes(data[str_off + name_off:end]).decode("ascii", "replace") if end >= 0 else ""
        if kind == 8:  # SHT_NOBITS: no bytes in the file
            size = 0
        if offset + size > len(data):
            raise FatbinError(f"section {name!r} [{offset:#x}, +{size:#x}) lies outside the file ({len(data)} bytes)")
        sections.append(Section(name, offset, size))
    return sections


def fatbin_sections(data: bytes | bytearray) -> list[Section]:
    found = [s for s in elf_sections(data) if s.name in FATBIN_SECTIONS and s.size]
    if not found:
        raise FatbinError(f"no device-code section ({' or '.join(FATBIN_SECTIONS)}) in this ELF file")
    return found


def parse_section(data: bytes | bytearray, section: Section) -> list[Entry]:
    """Every entry of every container in ``section``; the containers and their entries must tile it exactly."""
    entries: list[Entry] = []
    pos, end = section.offset, section.offset + section.size
    while pos < end:
        if end - pos < CONTAINER_HEADER.size or _u("<I", data, pos, "magic")[0] != FATBIN_MAGIC:
            gap = data[pos:min(end, pos + MAX_PADDING)]
            if end - pos < MAX_PADDING and not any(gap):
                break  # zero padding at the end of the section
            raise FatbinError(f"{section.name}: no fatbin container at offset {pos:#x} "
                              f"({pos - section.offset} bytes into the section; expected magic {FATBIN_MAGIC:#x})")
        magic, version, header_size, size = _u("<IHHQ", data, pos, f"{section.name} container header")
        if version != 1 or header_size != CONTAINER_HEADER.size:
            raise FatbinError(f"{section.name}: container at {pos:#x} has version {version} and header size "
                              f"{header_size}; expected version 1 and header size 16")
        container_end = pos + header_size + size
        if container_end > end:
            raise FatbinError(f"{section.name}: container at {pos:#x} claims {size} bytes of entries, "
                              f"{container_end - end} more than the section holds (truncated?)")
        at = pos + header_size
        while at < container_end:
            kind, _, entry_header, payload = _u("<HHIQ", data, at, f"{section.name} entry header")
            if entry_header < MIN_ENTRY_HEADER:
                raise FatbinError(f"{section.name}: entry at {at:#x} has a {entry_header}-byte header; "
                                  f"at least {MIN_ENTRY_HEADER} are needed to read its arch")
            if at + entry_header + payload > container_end:
                raise FatbinError(f"{section.name}: entry at {at:#x} ({entry_header} + {payload} bytes) runs "
                                  f"{at + entry_header + payload - container_end} bytes past its container at {pos:#x}")
            (arch,) = _u("<I", data, at + ARCH_OFFSET, "arch")
            entries.append(Entry(section.name, pos, at, kind, entry_header, payload, arch))
            at += entry_header + payload
        if at != container_end:  # cannot happen after the checks above; kept as the contract
            raise FatbinError(f"{section.name}: entries of the container at {pos:#x} do not tile it")
        pos = container_end
        pad = 0
        while pos < end and pad < MAX_PADDING and data[pos] == 0:  # a container starts with 0x50, never 0
            pos += 1
            pad += 1
    return entries


def parse(data: bytes | bytearray) -> list[Entry]:
    return [e for s in fatbin_sections(data) for e in parse_section(data, s)]


def strip(data: bytearray, arch: int) -> StripReport:
    """Zero, in place, every device image in ``data`` whose architecture is not ``arch``; FatbinError (with
    ``data`` unchanged) when the layout is not the expected one or no image of ``arch`` exists."""
    entries = parse(data)
    present = sorted({e.arch for e in entries})
    if arch not in present:
        raise FatbinError(f"no sm_{arch} image in this library (it has {', '.join(f'sm_{a}' for a in present)}): "
                          "stripping would leave no code for that GPU")
    report = StripReport(arch=arch, size=len(data), sections=tuple(dict.fromkeys(e.section for e in entries)))
    containers: dict[int, bool] = {}
    for e in entries:
        containers[e.container] = containers.get(e.container, False) or e.arch == arch
        start, stop = e.payload
        if e.arch == arch:
            report.kept_bytes[e.arch] = report.kept_bytes.get(e.arch, 0) + e.payload_size
            report.kept_entries += 1
        else:
            data[start:stop] = bytes(e.payload_size)
            report.zeroed_bytes[e.arch] = report.zeroed_bytes.get(e.arch, 0) + e.payload_size
            report.zeroed_entries += 1
    report.containers = len(containers)
    report.containers_without_arch = sum(1 for has in containers.values() if not has)
    return report


def verify_stripped(original: bytes | bytearray, stripped: bytes | bytearray, arch: int) -> None:
    """``stripped`` is ``original`` with exactly the non-``arch`` payloads zeroed; FatbinError otherwise."""
    if len(original) != len(stripped):
        raise FatbinError(f"stripped size {len(stripped)} differs from the original's {len(original)}")
    before, after = parse(original), parse(stripped)
    if [(e.offset, e.arch, e.payload_size) for e in before] != [(e.offset, e.arch, e.payload_size) for e in after]:
        raise FatbinError("the stripped library's fatbin layout differs from the original's")
    kept = 0
    cursor = 0
    for e in after:
        start, stop = e.payload
        if original[cursor:start] != stripped[cursor:start]:
            raise FatbinError(f"bytes outside device payloads changed before offset {start:#x}")
        if e.arch == arch:
            if original[start:stop] != stripped[start:stop]:
                raise FatbinError(f"the sm_{arch} image at {e.offset:#x} was changed")
            kept += 1
        elif stripped[start:stop] != bytes(e.payload_size):
            raise FatbinError(f"an sm_{e.arch} image at {e.offset:#x} was kept; only sm_{arch} may remain")
        cursor = stop
    if original[cursor:] != stripped[cursor:]:
        raise FatbinError("bytes after the last device payload changed")
    if kept == 0:
        raise FatbinError(f"no sm_{arch} image is left")


_CHUNK = 16 << 20


def _sha256(data: bytes | bytearray) -> str:
    return hashlib.sha256(data).hexdigest()


def _wheel_version(wheel: zipfile.ZipFile, name: str) -> str:
    for member in wheel.namelist():
        if member.endswith(".dist-info/METADATA"):
            for line in wheel.read(member).decode("utf-8", "replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    raise FatbinError(f"{name}: no Version in the wheel's METADATA")


def prepare(wheel_path: Path, out_dir: Path, arch: int, preset: int = 6) -> dict:
    """Wheel -> ``out_dir/libnccl.so.2.xz`` (stripped to ``arch``) + ``out_dir/manifest.json``; returns the manifest."""
    with zipfile.ZipFile(wheel_path) as wheel:
        if WHEEL_MEMBER not in wheel.namelist():
            raise FatbinError(f"{wheel_path.name} has no {WHEEL_MEMBER}")
        version = _wheel_version(wheel, wheel_path.name)
        original = wheel.read(WHEEL_MEMBER)
    stripped = bytearray(original)
    report = strip(stripped, arch)
    verify_stripped(original, stripped, arch)
    out_dir.mkdir(parents=True, exist_ok=True)
    artifact = out_dir / ARTIFACT
    tmp = artifact.with_suffix(".xz.part")
    with lzma.open(tmp, "wb", preset=preset) as f:
        view = memoryview(stripped)
        for i in range(0, len(view), _CHUNK):
            f.write(view[i:i + _CHUNK])
    tmp.replace(artifact)
    manifest = {
        "library": LIBRARY, "package": wheel_path.name.split("-")[0].replace("_", "-"), "nccl_version": version,
        "wheel": wheel_path.name, "arch": arch,
        "bytes": {"wheel": wheel_path.stat().st_size, "original": len(original),
                  "kept_device_code": sum(report.kept_bytes.values()), "xz": artifact.stat().st_size},
        "sha256": {"original": _sha256(original), "stripped": _sha256(stripped)},
        "kept_entries": report.kept_entries, "zeroed_entries": report.zeroed_entries,
        "zeroed_bytes_by_arch": {str(a): b for a, b in sorted(report.zeroed_bytes.items())},
        "containers": report.containers, "containers_without_arch": report.containers_without_arch,
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def describe(manifest: dict) -> list[str]:
    b = manifest["bytes"]
    mb = 1e6
    return [f"NCCL {manifest['nccl_version']} ({manifest['wheel']}, {b['wheel'] / mb:.1f} MB): {LIBRARY} "
            f"{b['original'] / mb:.1f} MB -> sm_{manifest['arch']} only, {b['kept_device_code'] / mb:.1f} MB of device "
            f"code kept -> {ARTIFACT} {b['xz'] / mb:.1f} MB ({b['xz'] / 2**20:.1f} MiB)",
            f"zeroed {manifest['zeroed_entries']} images of other arches: "
            + ", ".join(f"sm_{a} {n / mb:.1f} MB" for a, n in manifest["zeroed_bytes_by_arch"].items()),
            f"kept {manifest['kept_entries']} sm_{manifest['arch']} images; {manifest['containers']} containers, "
            f"{manifest['containers_without_arch']} without an sm_{manifest['arch']} image (none before either); "
            f"sha256 of the stripped library {manifest['sha256']['stripped'][:16]}..."]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("strip", help="strip one library file")
    one.add_argument("src", type=Path)
    one.add_argument("dst", type=Path)
    prep = sub.add_parser("prepare", help="strip the libnccl.so.2 of an NCCL wheel and xz it, with a manifest")
    prep.add_argument("wheel", type=Path)
    prep.add_argument("out_dir", type=Path)
    look = sub.add_parser("inspect", help="print the device images of a library by section and arch")
    look.add_argument("src", type=Path)
    for p in (one, prep):
        p.add_argument("--arch", type=int, default=90, help="compute capability to keep, no dot (default 90: sm_90)")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            data = args.src.read_bytes()
            totals: dict[tuple[str, int, int], int] = {}
            for e in parse(data):
                key = (e.section, e.kind, e.arch)
                totals[key] = totals.get(key, 0) + e.payload_size
            for (section, kind, arch), size in sorted(totals.items()):
                print(f"{section:16s} {KINDS.get(kind, kind)!s:4s} sm_{arch:<4d} {size / 1e6:8.1f} MB")
            return 0
        if args.command == "strip":
            original = args.src.read_bytes()
            data = bytearray(original)
            report = strip(data, args.arch)
            verify_stripped(original, data, args.arch)
            args.dst.write_bytes(data)
            print("\n".join(report.lines()))
            return 0
        manifest = prepare(args.wheel, args.out_dir, args.arch)
        print("\n".join(describe(manifest)))
        return 0
    except FatbinError as error:
        print(f"nccl_strip: refused: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
