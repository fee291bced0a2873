"""scripts/nccl_strip.py and scripts/nccl_install.py on synthetic libraries: an ELF64 file built here with the two
device-code sections NCCL has, holding fatbin containers of several arches. The stripper must keep exactly one
arch's payloads byte for byte, zero every other, touch nothing else, and refuse any layout it does not expect."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import lzma
import struct
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


strip_mod = _load("nccl_strip")
install_mod = _load("nccl_install")
FatbinError = strip_mod.FatbinError


def entry(kind: int, arch: int, payload: bytes, header_size: int = 64, size: int | None = None) -> bytes:
    """One fatbin entry: kind, version, header size, payload size, the arch at byte 28, then the payload."""
    head = struct.pack("<HHIQ", kind, 0x0101, header_size, len(payload) if size is None else size)
    if header_size < 32:  # too short to hold an arch: what the stripper must refuse
        return head + bytes(header_size - len(head)) + payload
    head += bytes(28 - len(head)) + struct.pack("<I", arch)
    return head + bytes(header_size - len(head)) + payload


def container(*entries: bytes, version: int = 1, size_delta: int = 0) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", strip_mod.FATBIN_MAGIC, version, 16, len(body) + size_delta) + body


def payload(arch: int, n: int = 40) -> bytes:
    return bytes(((arch * 7 + i) % 251) + 1 for i in range(n))  # never zero: a zeroed payload is visible


def elf(sections: dict[str, bytes]) -> bytearray:
    """A minimal ELF64 LE file: a header, the sections' bytes, a name table, the section header table."""
    names = b"\0" + b"".join(n.encode() + b"\0" for n in [*sections, ".shstrtab"])
    data = bytearray(64)
    layout = []
    for name, body in sections.items():
        layout.append((name, len(data), len(body)))
        data += body
    layout.append((".shstrtab", len(data), len(names)))
    data += names
    while len(data) % 8:
        data.append(0)
    shoff = len(data)
    data += bytes(64)  # section 0: null
    for name, offset, size in layout:
        name_off = names.index(name.encode() + b"\0")
        data += struct.pack("<IIQQQQIIQQ", name_off, 1, 2, 0, offset, size, 0, 0, 8, 0)
    data[0:4] = b"\x7fELF"
    data[4], data[5], data[6] = 2, 1, 1
    struct.pack_into("<Q", data, 0x28, shoff)
    struct.pack_into("<HHH", data, 0x3A, 64, len(layout) + 1, len(layout))
    return data


def library(**overrides: bytes) -> bytearray:
    """NCCL's layout in small: .text, then .nv_fatbin (two containers, one without sm_90) and __nv_relfatbin."""
    sections = {
        ".text": b"\x90" * 48,
        ".nv_fatbin": container(entry(2, 75, payload(75)), entry(2, 80, payload(80, 56)),
                                entry(2, 90, payload(90, 72)), entry(1, 120, payload(120, 24), header_size=96))
        + container(entry(2, 100, payload(100, 32), header_size=120)),
        "__nv_relfatbin": container(entry(2, 90, payload(91, 16)), entry(2, 100, payload(101, 16), header_size=112)),
        ".rodata": b"rodata-bytes-that-must-stay",
    }
    sections.update(overrides)
    return elf(sections)


def test_parse_reads_every_entry_of_both_sections():
    entries = strip_mod.parse(library())
    assert [(e.section, e.kind, e.arch, e.payload_size) for e in entries] == [
        (".nv_fatbin", 2, 75, 40), (".nv_fatbin", 2, 80, 56), (".nv_fatbin", 2, 90, 72), (".nv_fatbin", 1, 120, 24),
        (".nv_fatbin", 2, 100, 32), ("__nv_relfatbin", 2, 90, 16), ("__nv_relfatbin", 2, 100, 16)]


def test_strip_keeps_exactly_the_chosen_arch_and_nothing_else_changes():
    original = bytes(library())
    data = bytearray(original)
    report = strip_mod.strip(data, 90)
    assert (report.kept_entries, report.zeroed_entries) == (2, 5)
    assert report.kept_bytes == {90: 88} and report.zeroed_bytes == {75: 40, 80: 56, 100: 48, 120: 24}
    assert (report.containers, report.containers_without_arch) == (3, 1)
    for e in strip_mod.parse(data):
        start, stop = e.payload
        assert data[start:stop] == (original[start:stop] if e.arch == 90 else bytes(e.payload_size)), e
    changed = [i for i in range(len(data)) if data[i] != original[i]]
    payloads = [range(*e.payload) for e in strip_mod.parse(data) if e.arch != 90]
    assert changed and all(any(i in r for r in payloads) for i in changed), "only foreign payloads change"
    strip_mod.verify_stripped(original, data, 90)
    assert b"rodata-bytes-that-must-stay" in data and data[:64] == original[:64]


def test_negative_control_a_library_stripped_to_the_wrong_arch_fails_verification():
    original = bytes(library())
    wrong = bytearray(original)
    strip_mod.strip(wrong, 80)  # keeps sm_80, zeroes sm_90: useless on an H200
    with pytest.raises(FatbinError, match=r"an sm_80 image at .* was kept; only sm_90 may remain"):
        strip_mod.verify_stripped(original, wrong, 90)
    untouched = bytearray(original)
    with pytest.raises(FatbinError, match=r"an sm_75 image at .* was kept"):
        strip_mod.verify_stripped(original, untouched, 90)  # nothing stripped at all is caught too


def test_an_arch_the_library_lacks_is_refused_and_nothing_is_written():
    data = library()
    before = bytes(data)
    with pytest.raises(FatbinError, match=r"no sm_86 image in this library \(it has sm_75, sm_80, sm_90, sm_100, "
                                          r"sm_120\)"):
        strip_mod.strip(data, 86)
    assert bytes(data) == before


@pytest.mark.parametrize(("overrides", "message"), [
    ({".nv_fatbin": container(entry(2, 90, payload(90)), size_delta=64)}, r"claims .* bytes of entries, 64 more than "
                                                                          r"the section holds \(truncated\?\)"),
    ({".nv_fatbin": container(entry(2, 90, payload(90), size=48))}, r"runs 8 bytes past its container"),
    ({".nv_fatbin": container(entry(2, 90, payload(90)), version=2)}, r"version 2 and header size 16; expected"),
    ({".nv_fatbin": container(entry(2, 90, payload(90), header_size=24))}, r"24-byte header; at least 32"),
    ({".nv_fatbin": b"\x01" * 8 + container(entry(2, 90, payload(90)))}, r"no fatbin container at offset .* \(0 bytes"),
    ({".nv_fatbin": container(entry(2, 90, payload(90))) + b"\x07" * 8}, r"no fatbin container at offset"),
    ({".nv_fatbin": container(entry(2, 90, payload(90))) + bytes(40)}, r"no fatbin container at offset"),
])
def test_unexpected_layouts_are_refused(overrides, message):
    data = library(**overrides)
    before = bytes(data)
    with pytest.raises(FatbinError, match=message):
        strip_mod.strip(data, 90)
    assert bytes(data) == before


def test_zero_padding_between_containers_is_accepted():
    padded = container(entry(2, 90, payload(90))) + bytes(8) + container(entry(2, 80, payload(80)))
    data = library(**{".nv_fatbin": padded})
    assert [e.arch for e in strip_mod.parse(data) if e.section == ".nv_fatbin"] == [90, 80]


def test_files_that_are_not_a_64_bit_elf_with_device_code_are_refused():
    with pytest.raises(FatbinError, match="not an ELF file"):
        strip_mod.parse(b"MZ" + bytes(200))
    thirty_two = library()
    thirty_two[4] = 1
    with pytest.raises(FatbinError, match="only 64-bit little-endian ELF"):
        strip_mod.parse(thirty_two)
    with pytest.raises(FatbinError, match=r"no device-code section \(.nv_fatbin or __nv_relfatbin\)"):
        strip_mod.parse(elf({".text": b"\x90" * 16}))
    truncated = library()[:200]
    with pytest.raises(FatbinError, match="runs past the end of the file|outside the file"):
        strip_mod.parse(truncated)


def _wheel(path: Path, lib: bytes, version: str = "2.32.3") -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(strip_mod.WHEEL_MEMBER, lib)
        z.writestr(f"nvidia_nccl_cu13-{version}.dist-info/METADATA", f"Name: nvidia-nccl-cu13\nVersion: {version}\n")
    return path


def test_prepare_writes_the_xz_and_a_manifest_that_describe_the_stripped_library(tmp_path):
    lib = bytes(library())
    wheel = _wheel(tmp_path / "nvidia_nccl_cu13-2.32.3-py3-none-manylinux_2_27_x86_64.whl", lib)
    manifest = strip_mod.prepare(wheel, tmp_path / "nccl", 90)
    stripped = lzma.decompress((tmp_path / "nccl" / strip_mod.ARTIFACT).read_bytes())
    strip_mod.verify_stripped(lib, stripped, 90)
    assert manifest == json.loads((tmp_path / "nccl" / strip_mod.MANIFEST).read_text())
    assert manifest["nccl_version"] == "2.32.3" and manifest["arch"] == 90 and manifest["package"] == "nvidia-nccl-cu13"
    assert manifest["sha256"]["stripped"] == hashlib.sha256(stripped).hexdigest()
    assert manifest["bytes"]["original"] == len(lib) and manifest["bytes"]["kept_device_code"] == 88
    lines = strip_mod.describe(manifest)
    assert "NCCL 2.32.3" in lines[0] and "sm_90 only" in lines[0] and "libnccl.so.2.xz" in lines[0]
    assert "sm_75" in lines[1] and "kept 2 sm_90 images" in lines[2]


def test_cli_refuses_with_a_message_and_exit_code_2(tmp_path, capsys):
    wheel = _wheel(tmp_path / "n.whl", bytes(library()))
    assert strip_mod.main(["prepare", str(wheel), str(tmp_path / "out"), "--arch", "86"]) == 2
    assert "nccl_strip: refused: no sm_86 image" in capsys.readouterr().err
    assert not (tmp_path / "out" / strip_mod.ARTIFACT).exists()
    src = tmp_path / "lib.so"
    src.write_bytes(bytes(library()))
    assert strip_mod.main(["inspect", str(src)]) == 0
    assert "sm_90" in capsys.readouterr().out


# ---- scripts/nccl_install.py: the carried library over the image's ----------------------------------------------

def _carried(tmp_path: Path, arch: int = 90) -> tuple[Path, bytes]:
    lib = bytes(library())
    strip_mod.prepare(_wheel(tmp_path / "n.whl", lib), tmp_path / "nccl", arch)
    return tmp_path / "nccl", lzma.decompress((tmp_path / "nccl" / strip_mod.ARTIFACT).read_bytes())


def test_install_replaces_every_target_and_then_finds_them_in_place(tmp_path, capsys):
    carried, stripped = _carried(tmp_path)
    site = tmp_path / "site" / "nvidia" / "nccl" / "lib"
    site.mkdir(parents=True)
    old = site / "libnccl.so.2"
    old.write_bytes(b"old nccl 2.28.9")
    old.chmod(0o755)
    usr = tmp_path / "usr_lib" / "libnccl.so.2.28.9"
    usr.parent.mkdir()
    usr.write_bytes(b"old system nccl")
    (usr.parent / "libnccl.so.2").symlink_to(usr.name)
    targets = install_mod.default_targets([str(tmp_path / "site"), "", str(tmp_path / "missing")],
                                          (str(usr.parent / "libnccl.so.2*"),))
    assert targets == [old, usr]  # the symlink and its target are one file
    assert install_mod.install(carried, targets, 90, dry_run=True) == 0
    assert old.read_bytes() == b"old nccl 2.28.9"
    assert install_mod.install(carried, targets, 90, dry_run=False) == 0
    assert old.read_bytes() == stripped and usr.read_bytes() == stripped
    assert (usr.parent / "libnccl.so.2").read_bytes() == stripped and old.stat().st_mode & 0o777 == 0o755
    assert install_mod.install(carried, targets, 90, dry_run=False) == 0
    out = capsys.readouterr().out
    assert out.count("replaced by NCCL 2.32.3 sm_90") == 2 and out.count("already NCCL 2.32.3 sm_90") == 2
    assert not list(site.glob(".*"))  # no staged or temporary file left behind


def test_install_refuses_another_arch_a_corrupt_artifact_and_no_target(tmp_path, capsys):
    carried, _ = _carried(tmp_path)
    target = tmp_path / "libnccl.so.2"
    target.write_bytes(b"old")
    assert install_mod.install(carried, [target], 100, dry_run=False) == install_mod.REFUSED
    assert "this GPU is sm_100, the carried NCCL has sm_90 code only" in capsys.readouterr().out
    assert install_mod.install(carried, [], 90, dry_run=False) == install_mod.REFUSED
    assert install_mod.install(carried, [target], None, dry_run=False) == install_mod.REFUSED
    manifest = json.loads((carried / install_mod.MANIFEST).read_text())
    manifest["sha256"]["stripped"] = "0" * 64
    (carried / install_mod.MANIFEST).write_text(json.dumps(manifest))
    assert install_mod.install(carried, [target], 90, dry_run=False) == install_mod.REFUSED
    assert "differs from the manifest's" in capsys.readouterr().out and target.read_bytes() == b"old"
    assert install_mod.main(["--dir", str(tmp_path / "nothing")]) == install_mod.REFUSED


def test_the_xz_stream_is_standard(tmp_path):
    """The GPU side decompresses with Python's lzma module alone (no xz binary needed there)."""
    carried, stripped = _carried(tmp_path)
    out = io.BytesIO()
    with lzma.open(carried / strip_mod.ARTIFACT) as f:
        out.write(f.read())
    assert out.getvalue() == stripped
