"""Directory-tree snapshots: a cheap one (paths + sizes, for polling) and a full one
(paths, types, sizes, SHA-256 of contents, symlink targets) for verification."""
from __future__ import annotations

import fnmatch
import hashlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor

# Tool-internal names that are not part of the replicated data.
INTERNAL_TOP = {".stfolder", ".stversions", ".stignore", ".meshfs", ".unison"}
INTERNAL_GLOBS = [".syncthing.*.tmp", "~syncthing~*.tmp", ".unison.*", ".#*.meshfs*",
                  "*.meshfs-tmp*", ".meshfs-*"]


def is_internal(rel: str) -> bool:
    parts = rel.split("/")
    if parts[0] in INTERNAL_TOP:
        return True
    name = parts[-1]
    return any(fnmatch.fnmatchcase(name, g) for g in INTERNAL_GLOBS)


def _walk(root):
    """Yield (relpath, DirEntry) for everything under root, not following symlinks."""
    stack = [""]
    while stack:
        rel = stack.pop()
        path = os.path.join(root, rel) if rel else root
        try:
            it = os.scandir(path)
        except FileNotFoundError:
            continue
        with it:
            for e in it:
                r = f"{rel}/{e.name}" if rel else e.name
                if is_internal(r):
                    continue
                yield r, e
                if e.is_dir(follow_symlinks=False):
                    stack.append(r)


def sizes(root, under=None):
    """{relpath: size or 'd' or 'l'} — lstat only; cheap enough to poll."""
    base = os.path.join(root, under) if under else root
    out = {}
    for rel, e in _walk(base):
        key = f"{under}/{rel}" if under else rel
        try:
            if e.is_dir(follow_symlinks=False):
                out[key] = "d"
            elif e.is_symlink():
                out[key] = "l"
            else:
                out[key] = e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
    return out


def _hash_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def manifest(root, workers=2):
    """{relpath: (type, size, digest-or-target, mode, mtime_s)}"""
    entries = {}
    files = []
    for rel, e in _walk(root):
        st = e.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            entries[rel] = ("d", 0, "", stat.S_IMODE(st.st_mode), None)
        elif stat.S_ISLNK(st.st_mode):
            entries[rel] = ("l", 0, os.readlink(os.path.join(root, rel)), None, None)
        elif stat.S_ISREG(st.st_mode):
            entries[rel] = ("f", st.st_size, None, stat.S_IMODE(st.st_mode), int(st.st_mtime))
            files.append(rel)
        else:
            entries[rel] = ("?", 0, "", None, None)
    with ThreadPoolExecutor(workers) as ex:
        for rel, dig in zip(files, ex.map(lambda r: _hash_file(os.path.join(root, r)), files)):
            t, size, _, mode, mtime = entries[rel]
            entries[rel] = (t, size, dig, mode, mtime)
    return entries


def compare(src, dst, limit=8):
    """Compare two manifests. Content = path set, type, size, hash, symlink target.
    Meta = permission bits and mtime (whole seconds) of regular files: reported, but not
    treated as a failure. Returns a dict with counts and the first few differences."""
    content, meta = [], []
    for rel in sorted(set(src) | set(dst)):
        a, b = src.get(rel), dst.get(rel)
        if a is None:
            content.append(f"extra on destination: {rel}")
        elif b is None:
            content.append(f"missing on destination: {rel}")
        elif a[:3] != b[:3]:
            content.append(f"differs: {rel} ({a[0]},{a[1]}) vs ({b[0]},{b[1]})")
        elif a[0] == "f" and (a[3] != b[3] or a[4] != b[4]):
            meta.append(f"{rel}: mode {a[3]:o}/{b[3]:o} mtime {a[4]}/{b[4]}")
    return {"content_diffs": len(content), "content_examples": content[:limit],
            "meta_diffs": len(meta), "meta_examples": meta[:3]}


def count_and_bytes(sz):
    files = sum(1 for v in sz.values() if isinstance(v, int))
    total = sum(v for v in sz.values() if isinstance(v, int))
    return files, total
