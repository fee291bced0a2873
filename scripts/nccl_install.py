"""Put the carried NCCL (``gpu_check.sh --fetch-wheels``: libnccl.so.2 stripped to one GPU arch, xz) in place of the
image's, before anything loads NCCL, so that torch and cupy both map it.

Why overwrite instead of LD_PRELOAD or LD_LIBRARY_PATH: torch's libtorch_cuda finds libnccl.so.2 through its RPATH
(site-packages ``nvidia/nccl/lib``), and cupy loads the soname that is already mapped; replacing the file itself
is the one way both processes get the same library (the GPU run for issue 17 did it by hand). Which files: every
``nvidia/nccl/lib/libnccl.so.2*`` under this interpreter's ``sys.path``, and every ``libnccl.so.2*`` under
``/usr/lib*`` (symlinks resolved; each real file once). Each is replaced atomically (``os.replace`` of a complete
copy), so a process that has the old one mapped keeps a valid mapping.

Refuses (exit 3), before writing anything, when the decompressed library's sha256 differs from the manifest's, or
when the GPU's architecture differs from the one kept (that GPU would find no NCCL kernel); then nothing is changed.
The versions torch and cupy load afterwards, and the mapped paths, are printed by ``scripts/gpu_plan.py``.

    python scripts/nccl_install.py [--dir .whl/nccl] [--dry-run] [--gpu-arch 90] [--target PATH ...]
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

LIBRARY = "libnccl.so.2"
ARTIFACT = LIBRARY + ".xz"
MANIFEST = "manifest.json"
REFUSED = 3
_CHUNK = 16 << 20


def load_manifest(directory: Path) -> dict:
    manifest = json.loads((directory / MANIFEST).read_text())
    for key in ("nccl_version", "arch", "sha256", "bytes"):
        if key not in manifest:
            raise ValueError(f"{directory / MANIFEST}: no {key!r}")
    return manifest


def default_targets(paths: list[str] | None = None, usr_globs: tuple[str, ...] = ("/usr/lib*/libnccl.so.2*",
                                                                                    "/usr/lib*/*/libnccl.so.2*")
                    ) -> list[Path]:
    """The real files behind every libnccl.so.2* this interpreter's packages and /usr/lib* hold, each once."""
    found: list[str] = []
    for entry in paths if paths is not None else sys.path:
        if entry and os.path.isdir(entry):
            found += glob.glob(os.path.join(entry, "nvidia", "nccl", "lib", LIBRARY + "*"))
    for pattern in usr_globs:
        found += glob.glob(pattern)
    real: dict[str, None] = {}
    for path in sorted(found):
        resolved = os.path.realpath(path)
        if os.path.isfile(resolved) and not resolved.endswith((".xz", ".tmp")):
            real.setdefault(resolved)
    return [Path(p) for p in real]


def gpu_arch() -> int | None:
    """The first GPU's compute capability as 90 (sm_90); None when it cannot be read here (no GPU, no tools).

    Read without loading torch in this process (torch maps libnccl on import): nvidia-smi, else a child python."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        first = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
        if first:
            major, minor = first.split(".")
            return int(major) * 10 + int(minor)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    try:
        out = subprocess.run([sys.executable, "-c", "import torch; c = torch.cuda.get_device_capability(0) "
                              "if torch.cuda.is_available() else None; print(c[0] * 10 + c[1] if c else '')"],
                             capture_output=True, text=True, timeout=120)
        return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def decompress(artifact: Path, dst: Path) -> str:
    """``artifact`` (xz) -> ``dst``; returns the sha256 of what was written."""
    digest = hashlib.sha256()
    with lzma.open(artifact, "rb") as src, open(dst, "wb") as out:
        for chunk in iter(lambda: src.read(_CHUNK), b""):
            digest.update(chunk)
            out.write(chunk)
    return digest.hexdigest()


def replace(src: Path, target: Path) -> None:
    """Copy ``src`` next to ``target``, keep ``target``'s mode, and rename it over ``target`` (atomic)."""
    tmp = target.with_name(f".{target.name}.owner_reduce.tmp")
    shutil.copyfile(src, tmp)
    os.chmod(tmp, target.stat().st_mode & 0o7777)
    os.replace(tmp, target)


def install(directory: Path, targets: list[Path], arch: int | None, dry_run: bool) -> int:
    manifest = load_manifest(directory)
    artifact = directory / ARTIFACT
    version, kept = manifest["nccl_version"], int(manifest["arch"])
    mb = 1e6
    print(f"nccl_install: carried NCCL {version}, sm_{kept} only: {artifact} {artifact.stat().st_size / mb:.1f} MB "
          f"-> {manifest['bytes']['original'] / mb:.1f} MB", flush=True)
    if arch is None:
        print(f"nccl_install: the GPU's architecture is unknown here; it must be sm_{kept}", flush=True)
        if not dry_run:
            print("nccl_install: REFUSED: cannot read the GPU's compute capability (nvidia-smi, torch)", flush=True)
            return REFUSED
    elif arch != kept:
        print(f"nccl_install: REFUSED: this GPU is sm_{arch}, the carried NCCL has sm_{kept} code only; prepare it "
              f"with: bash scripts/gpu_check.sh --fetch-wheels --arch {arch}", flush=True)
        return REFUSED
    if not targets:
        print("nccl_install: REFUSED: no libnccl.so.2 under this python's nvidia/nccl/lib or /usr/lib*: nothing that "
              "torch would load", flush=True)
        return REFUSED
    if dry_run:
        for t in targets:
            print(f"nccl_install: would overwrite {t} ({t.stat().st_size / mb:.1f} MB)", flush=True)
        return 0
    want = manifest["sha256"]["stripped"]
    staged = targets[0].with_name(f".{LIBRARY}.owner_reduce.staged")
    try:
        got = decompress(artifact, staged)
        if got != want:
            print(f"nccl_install: REFUSED: the decompressed library's sha256 {got[:16]}... differs from the "
                  f"manifest's {want[:16]}...; nothing was replaced", flush=True)
            return REFUSED
        failed = 0
        for t in targets:
            if t.stat().st_size == manifest["bytes"]["original"] and sha256_of(t) == want:
                print(f"nccl_install: {t}: already NCCL {version} sm_{kept}", flush=True)
                continue
            try:
                replace(staged, t)
            except OSError as error:
                failed += 1
                print(f"nccl_install: FAILED to replace {t}: {type(error).__name__}: {error}", flush=True)
                continue
            print(f"nccl_install: {t}: replaced by NCCL {version} sm_{kept}", flush=True)
    finally:
        staged.unlink(missing_ok=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path(".whl/nccl"), help="what --fetch-wheels prepared")
    parser.add_argument("--dry-run", action="store_true", help="say what would be replaced; write nothing")
    parser.add_argument("--gpu-arch", type=int, default=None, help="the GPU's arch (default: read it)")
    parser.add_argument("--target", type=Path, action="append", default=None,
                        help="a file to replace (default: every libnccl.so.2 this python and /usr/lib* hold)")
    args = parser.parse_args(argv)
    if not (args.dir / MANIFEST).is_file() or not (args.dir / ARTIFACT).is_file():
        print(f"nccl_install: nothing carried: no {args.dir / ARTIFACT} with {MANIFEST} "
              "(bash scripts/gpu_check.sh --fetch-wheels prepares it)", flush=True)
        return REFUSED
    targets = args.target if args.target is not None else default_targets()
    arch = args.gpu_arch if args.gpu_arch is not None else gpu_arch()
    return install(args.dir, targets, arch, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
