"""Where the recorder's compiled kernels (tracer/jit.py) are kept between processes, and how a
process loads them: from the cache, or by compiling the IR with llvmlite.

The cache, in `$WARNINGLIGHT_CACHE_DIR`, else `$XDG_CACHE_HOME/warninglight`, else
`~/.cache/warninglight`, holds two forms of the code:

- a shared library, `kernels-<key>.so`, keyed by the IR text and the CPU as `/proc/cpuinfo`
  describes it. A process that finds it loads it with `dlopen` and never imports llvmlite, whose
  own library (all of LLVM) takes most of the loading time and memory otherwise. It is linked
  from the object code by the system's C compiler driver (`$CC`, else `cc`, `gcc` or `clang`)
  the first time a process compiles, or finds the object code but not the library; where there
  is none, or no `/proc/cpuinfo`, every process maps the object code instead;
- the object code, `kernels-<key>.o`, keyed by the IR text, the llvmlite and LLVM versions, and
  the host CPU and its features as LLVM names them, mapped into the process by llvmlite.

Each file's SHA-256 is checked before it is loaded (the object file carries it; the library has
it beside it, in `kernels-<key>.so.sha256`); a file cut short or not ours is made again, never
loaded. Files are written under a temporary name and renamed into place (ranks that compile at
once leave whole files). A cache that cannot be read or written only means compiling again.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from .jit import IR, SIGNATURES

_MAGIC = b"warninglight-kernels-1\n"
# the /proc/cpuinfo fields that say which code a CPU runs (x86, then ARM); not its clock or count
_CPU_FIELDS = frozenset(("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "Features",
                         "CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision"))
_LINK_TIMEOUT_S = 60


def cache_dir() -> Path:
    """Where the compiled object code is kept between processes."""
    if env := os.environ.get("WARNINGLIGHT_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "warninglight"


def load() -> tuple[dict[str, Any], str]:
    """The compiled functions by name, callable through ctypes, and where their code came from:
    "library" (the cached shared library: llvmlite not imported), "object" (the cached object
    code) or "compiled". Raises when the library cannot be used and llvmlite is missing, older than
    0.45, or cannot compile here."""
    key = _library_key()
    library = None if key is None else cache_dir() / f"kernels-{key}.so"
    if library is not None and _library_off(library):
        library = None
    if library is not None and (funcs := _load_library(library)) is not None:
        return funcs, "library"
    import llvmlite
    import llvmlite.binding as llvm

    if tuple(int(v) for v in llvmlite.__version__.split(".")[:2]) < (0, 45):
        # the IR is written with opaque pointers, which earlier versions do not parse
        raise RuntimeError(f"llvmlite {llvmlite.__version__} is older than 0.45")
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    # position-independent: the same object code is mapped here and linked into the library
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=cpu, features=features, opt=3, jit=True, reloc="pic")
    obj_key = hashlib.sha256("\0".join(
        (IR, "pic", llvmlite.__version__, ".".join(map(str, llvm.llvm_version_info)), cpu, features)).encode()).hexdigest()
    path = cache_dir() / f"kernels-{obj_key[:24]}.o"
    obj, source = _read(path), "object"
    if obj is None:
        source = "compiled"
        module = llvm.parse_assembly(IR)
        module.verify()
        tuning = llvm.create_pipeline_tuning_options(speed_level=3)
        tuning.loop_vectorization = tuning.slp_vectorization = True
        builder = llvm.create_pass_builder(machine, tuning)
        builder.getModulePassManager().run(module, builder)
        obj = machine.emit_object(module)
        _write(path, obj)
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), machine)
    engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
    engine.finalize_object()
    funcs: dict[str, Any] = {"_engine": engine}  # the engine owns the code: kept alive with them
    for name, (ret, args) in SIGNATURES.items():
        address = engine.get_function_address(name)
        if not address:
            raise RuntimeError(f"the compiled kernels lack {name}")
        funcs[name] = ctypes.CFUNCTYPE(ret, *args)(address)
    if library is not None and not _library_off(library):  # missing or not whole: for the next process
        _link_library(obj, library)
    return funcs, source


def _cpu_identity() -> str | None:
    """The first CPU's `_CPU_FIELDS` in /proc/cpuinfo; None where there is no such file."""
    fields = []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU's block ends
                name, _, value = line.partition(":")
                if name.strip() in _CPU_FIELDS:
                    fields.append(f"{name.strip()}={value.strip()}")
    except OSError:
        return None
    return "\n".join(fields) or None


def _library_key() -> str | None:
    """The shared library's key: the IR and the CPU it was compiled for (None: the CPU is not
    known without LLVM, so there is no library)."""
    cpu = _cpu_identity()
    if cpu is None:
        return None
    return hashlib.sha256("\0".join((IR, platform.machine(), cpu)).encode()).hexdigest()[:24]


def _library_off(path: Path) -> bool:
    """Whether the library at `path` was found not to link or not to load here: then no process
    tries again (each would pay for it) until `<library>.off`, which says why, is deleted."""
    return path.with_name(path.name + ".off").exists()


def _turn_library_off(path: Path, why: str) -> None:
    with contextlib.suppress(OSError):
        path.with_name(path.name + ".off").write_text(why + "\n")


def _load_library(path: Path) -> dict[str, Any] | None:
    """The functions of the cached shared library at `path`, if it is there, whole and loads
    (one that is whole but does not load, e.g. from a cache on a noexec mount, turns it off)."""
    try:
        code, digest = path.read_bytes(), path.with_name(path.name + ".sha256").read_text().strip()
    except OSError:
        return None
    if hashlib.sha256(code).hexdigest() != digest:
        return None  # cut short, or not ours: linked again by the next compile
    try:
        lib = ctypes.CDLL(str(path))
        funcs: dict[str, Any] = {"_library": lib}  # the library owns the code: kept alive with them
        for name, (ret, args) in SIGNATURES.items():
            funcs[name] = ctypes.CFUNCTYPE(ret, *args)(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value)
    except (OSError, AttributeError) as exc:
        _turn_library_off(path, f"did not load: {type(exc).__name__}: {exc}")
        return None
    return funcs


def _linker() -> list[str] | None:
    """The C compiler driver that links the library: `$CC`, else the first of cc, gcc, clang."""
    if cc := os.environ.get("CC", "").strip():
        return shlex.split(cc)
    found = next((shutil.which(name) for name in ("cc", "gcc", "clang") if shutil.which(name)), None)
    return [found] if found else None


def _link_library(obj: bytes, path: Path) -> None:
    """Link the object code `obj` into the shared library at `path`, with its digest beside it;
    nothing happens where there is no linker or the cache cannot be written."""
    cc = _linker()
    if cc is None:
        return
    work = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=path.parent, prefix=".kernels-link-"))
        (work / "k.o").write_bytes(obj)
        try:
            subprocess.run([*cc, "-shared", "-o", str(work / "k.so"), str(work / "k.o")], check=True,
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=_LINK_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            _turn_library_off(path, f"{shlex.join(cc)} did not link it: {type(exc).__name__}: {exc}")
            return
        code = (work / "k.so").read_bytes()
        (work / "k.sha256").write_text(hashlib.sha256(code).hexdigest())
        # the digest first: a reader between the two renames finds them apart and loads neither
        os.replace(work / "k.sha256", path.with_name(path.name + ".sha256"))
        os.replace(work / "k.so", path)
    except (OSError, ValueError):
        pass  # the cache cannot be written: the next process maps the object code, and tries again
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


def _read(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head, digest, code = data[:len(_MAGIC)], data[len(_MAGIC):len(_MAGIC) + 32], data[len(_MAGIC) + 32:]
    if head != _MAGIC or hashlib.sha256(code).digest() != digest:
        return None  # not ours, or cut short: compiled again and rewritten
    return code


def _write(path: Path, code: bytes) -> None:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".kernels-")
        with os.fdopen(fd, "wb") as f:
            f.write(_MAGIC + hashlib.sha256(code).digest() + code)
        os.replace(tmp, path)
    except OSError:  # a read-only home, a full disk: the next process compiles again
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
