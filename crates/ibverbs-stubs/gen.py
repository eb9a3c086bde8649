#!/usr/bin/env python3
"""Generate the stand-in provider libraries' exports from Debian's own.

For each of libmlx5, libefa, libmlx4 and libmana this reads, on a Debian 12 host with
ibverbs-providers and libibverbs-dev installed:

  * the installed library (`nm -D --with-symbol-versions`, `readelf -V`): every exported
    function, the version node it is exported at (default `@@` or hidden `@`), and the
    chain of version nodes;
  * the installed header (`<infiniband/mlx5dv.h>` …, through `gcc -E`): each function's C
    prototype;

and writes, in `crates/ibverbs-stubs/<lib>/`:

  * `lib<lib>.map`, the version script (`build.rs` hands it to the linker);
  * `src/exports.rs`, one Rust function per C function with the C prototype as its doc
    comment and the `.symver` directives that bind each to its version node.

What each function does follows from its return type and the convention its manual page
documents (RETURN VALUE), see `CONVENTION` below: no device behind these libraries is
theirs, so every call fails with EOPNOTSUPP in the way the caller checks for it.

    crates/ibverbs-stubs/gen.py           # rewrite the files
    crates/ibverbs-stubs/gen.py --check   # exit 1 if a checked-in file differs

The output goes through rustfmt, so `cargo fmt` leaves it as it is.
"""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LIBDIR = "/usr/lib/x86_64-linux-gnu"

# (crate directory and library name, header)
LIBS = [
    ("mlx5", "mlx5dv.h"),
    ("efa", "efadv.h"),
    ("mlx4", "mlx4dv.h"),
    ("mana", "manadv.h"),
]

# How a failing call reports itself, where the manual page documents something other than
# its family's rule. The rule: a function returning int returns the errno value (0 on
# success); one returning a pointer returns NULL and sets errno; bool is false; void does
# nothing (it only frees objects these libraries never hand out).
CONVENTION = {
    # "otherwise -1 will be returned and errno was set"
    "mlx5dv_devx_get_event": "minus_one",
    # returns a file descriptor: -1 and errno, as every call returning one
    "mlx5dv_vfio_get_events_fd": "minus_one",
    # "Number of work requests that were canceled, or -errno on error"
    "mlx5dv_qp_cancel_posted_send_wrs": "neg_errno",
}

SCALARS = {
    "int": "c_int",
    "uint8_t": "u8",
    "uint16_t": "u16",
    "uint32_t": "u32",
    "uint64_t": "u64",
    "__be32": "u32",
    "__be64": "u64",
    "size_t": "usize",
    "ssize_t": "isize",
    "_Bool": "bool",
    "void": "()",
}


def run(*cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def exports(lib):
    """[(name, node, default)] in nm's order."""
    out = run("nm", "-D", "--with-symbol-versions", "--defined-only", f"{LIBDIR}/lib{lib}.so.1")
    syms = []
    for line in out.splitlines():
        _addr, kind, sym = line.split()
        if kind == "A":  # the version nodes themselves
            continue
        if kind != "T":
            sys.exit(f"lib{lib}: {sym} is not a function ({kind})")
        default = "@@" in sym
        name, node = re.split("@@?", sym)
        syms.append((name, node, default))
    return syms


def nodes(lib):
    """[(node, parent or None)] in definition order."""
    out = run("readelf", "-V", "-W", f"{LIBDIR}/lib{lib}.so.1")
    sect = out.split("Version definition section")[1].split("Version needs section")[0]
    res = []
    for line in sect.splitlines():
        m = re.search(r"Flags: (\S+)\s+Index: \d+\s+Cnt: \d+\s+Name: (\S+)", line)
        if m:
            if m.group(1) != "BASE":
                res.append([m.group(2), None])
            continue
        m = re.search(r"Parent 1: (\S+)", line)
        if m and res:
            res[-1][1] = m.group(1)
    return [tuple(n) for n in res]


def prototypes(header):
    src = run("gcc", "-E", "-P", "-x", "c", "-", input=f"#include <infiniband/{header}>\n")
    return re.sub(r"\s+", " ", src)


def prototype(flat, name):
    m = re.search(r"(?:^|[;}])\s*([^;{}]*?\b" + re.escape(name) + r"\s*\(([^;{}()]*)\))\s*;", flat)
    if not m:
        sys.exit(f"no prototype for {name}")
    proto = re.sub(r"\s*\*\s*", " *", m.group(1).strip()).replace("( ", "(")
    proto = re.sub(r"\*\s+(?=[\w*])", "*", proto)
    ret = proto[: proto.index(name)].strip()
    return proto, ret, m.group(2).strip()


def rust_type(ctype):
    """The Rust type of a C parameter or return type (pointers are opaque here)."""
    t = ctype.strip()
    if "*" in t or t.endswith("[]"):
        depth = t.count("*") + t.count("[]")
        inner = "*mut c_void" if not t.startswith("const") else "*const c_void"
        return "*mut " * (depth - 1) + inner
    if t.startswith("enum "):
        return "u32"  # a C enum with no negative values is an unsigned int
    if t not in SCALARS:
        sys.exit(f"no Rust type for {t!r}")
    return SCALARS[t]


def params(plist):
    if plist in ("", "void"):
        return []
    res = []
    for p in plist.split(","):
        p = p.strip()
        m = re.match(r"(.*?)(\w+)\s*(\[\])?$", p)
        ctype = m.group(1) + ("[]" if m.group(3) else "")
        res.append((m.group(2), rust_type(ctype)))
    return res


def body(name, ret):
    conv = CONVENTION.get(name)
    if conv == "minus_one":
        return "unsupported_minus_one()", "Fails: -1, with errno `EOPNOTSUPP`."
    if conv == "neg_errno":
        return "-unsupported_errno()", "Fails: `-EOPNOTSUPP`."
    if ret == "()":
        return None, "Does nothing: no object this library hands out exists."
    if ret == "bool":
        return "false", "No device is this provider's: false."
    if ret == "c_int":
        return "unsupported_errno()", "Fails: returns `EOPNOTSUPP` (and sets errno to it)."
    if ret.startswith("*"):
        return "unsupported_null()", "Fails: NULL, with errno `EOPNOTSUPP`."
    sys.exit(f"{name}: no failure for return type {ret}")


def generate(lib, header):
    syms = exports(lib)
    chain = nodes(lib)
    flat = prototypes(header)
    by_name = {}
    for name, node, default in syms:
        by_name.setdefault(name, []).append((node, default))

    # Version script: each node's names, each node inheriting from its parent.
    order = [n for n, _ in chain]
    per_node = {n: sorted({s for s, nd, _ in syms if nd == n}) for n in order}
    mlines = [f"/* Generated by crates/ibverbs-stubs/gen.py from Debian 12's lib{lib}.so.1. */"]
    for n, parent in chain:
        names = " ".join(f"{s};" for s in per_node[n])
        glob = f" global: {names}" if names else ""
        mlines.append(f"{n} {{{glob} }}{' ' + parent if parent else ''};")
    mapfile = "\n".join(mlines) + "\n"

    funcs = []
    for name in sorted(by_name):
        proto, cret, plist = prototype(flat, name)
        ret = rust_type(cret)
        expr, doc = body(name, ret)
        vs = sorted(by_name[name], key=lambda v: not v[1])
        vers = vs[0][0] + "".join(f"; also {n}, for programs linked before {vs[0][0]}" for n, _ in vs[1:])
        args = ", ".join(f"_{p}: {t}" for p, t in params(plist))
        funcs += [
            "",
            f"/// `{proto}` ({vers})",
            "///",
            f"/// {doc}",
            "#[no_mangle]",
        ]
        sig = f"pub extern \"C\" fn {name}({args})" + ("" if ret == "()" else f" -> {ret}")
        funcs.append(f"{sig} {{" + (f" {expr} " if expr else "") + "}")
    # The answers live in ../unsupported.rs, shared by the four libraries.
    used = [h for h in ("unsupported_errno", "unsupported_minus_one", "unsupported_null")
            if any(h + "()" in f for f in funcs)]
    helpers = f"\nuse crate::unsupported::{{{', '.join(used)}}};\n" if used else "\n"

    out = [
        f"// Generated by crates/ibverbs-stubs/gen.py from Debian 12's lib{lib}.so.1 (the",
        f"// functions and their version nodes) and <infiniband/{header}> (their C",
        "// prototypes). Do not edit: change the script and run it.",
        "",
        "use std::ffi::{c_int, c_void};",
        helpers,
        "// Each function at the version node Debian's library exports it at; `@@` is the",
        "// default a program links to today, `@` an older version kept for programs linked then.",
        "#[cfg(not(test))]",
        "core::arch::global_asm!(",
    ]
    for name in sorted(by_name):
        for node, default in sorted(by_name[name], key=lambda v: order.index(v[0])):
            out.append(f'    ".symver {name}, {name}{"@@" if default else "@"}{node}",')
    out.append(");")
    out += funcs
    code = "\n".join(out) + "\n"
    code = run("rustfmt", "--edition", "2021", input=code)
    return mapfile, code


def main():
    check = "--check" in sys.argv[1:]
    stale = []
    for lib, header in LIBS:
        mapfile, code = generate(lib, header)
        for path, text in [
            (os.path.join(HERE, lib, f"lib{lib}.map"), mapfile),
            (os.path.join(HERE, lib, "src", "exports.rs"), code),
        ]:
            old = open(path).read() if os.path.exists(path) else None
            if old == text:
                continue
            if check:
                stale.append(path)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as f:
                    f.write(text)
                print(f"wrote {path}")
    if stale:
        print("out of date with the installed libraries and headers:", *stale, sep="\n  ")
        sys.exit(1)


if __name__ == "__main__":
    main()
